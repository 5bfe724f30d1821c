"""The mooncake sink against a real Mooncake master on loopback: a capture session's samples become packed objects
that speculators 0.9.0's own reader (``MooncakeHiddenStatesStore.get_sample``) decodes from the manifest the
connector announces; a dead master fails the capture with Mooncake's code named; a full store makes a put wait,
then fail with what to do; settings are checked."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
from test_session import H, rows_tagged, run

import mooncake_master as mm
from hscapture import ConfigError, OutputError, _native
from hscapture.output import mooncake
from support import new_req, sched

pytestmark = pytest.mark.skipif(mm.available() is not None, reason=str(mm.available()))


@pytest.fixture
def master(tmp_path):
    os.environ.update(mm.CLIENT_ENV)  # read by the clients' set-up in this process
    with mm.master(tmp_path / "master.log") as m:
        yield m


def store(master, **extra):
    given = {"master_server_address": master.address, "local_hostname": "127.0.0.1"}
    given |= {"global_segment_size": 64 << 20, "local_buffer_size": 16 << 20, **extra}
    return mooncake.Store(mooncake.settings(given, "test")).open()


def session(client):
    return _native.CaptureSession(
        [1, 3],
        "after",
        4,
        H,
        "float32",
        "float32",
        assemble=True,
        output=_native.Output({"kind": "store", "client": client}),
    )


def speculators_reader(master):
    from support import speculators_path

    root = speculators_path("0.9.0")
    if root is None or not (root / "hs_connectors").is_dir():
        pytest.skip("speculators 0.9.0 + hs-connectors 0.9.0 are not installed (scripts/setup.sh)")
    sys.path.insert(0, str(root))
    try:
        from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig
    finally:
        sys.path.remove(str(root))
    cfg = MooncakeStoreConfig(
        local_hostname="127.0.0.1",
        master_server_address=master.address,
        global_segment_size=0,
        local_buffer_size=16 << 20,
    )
    return MooncakeHiddenStatesStore(cfg).setup()


def test_samples_are_objects_speculators_reads_with_the_announced_manifest(master):
    import json

    s = session(store(master))
    run(
        s,
        sched(
            new=[new_req("cmpl-a.1", [1, 2, 3], None), new_req("7b", [4, 5, 6, 7, 8], None)], n={"cmpl-a.1": 3, "7b": 2}
        ),
        ["7b", "cmpl-a.1"],
        rows_tagged,
    )
    run(s, sched(cached=[("cmpl-a.1", 3), ("7b", 2)], n={"cmpl-a.1": 1, "7b": 3}), ["cmpl-a.1", "7b"], rows_tagged)
    assert s.drain() == [], "no ledger: the objects are the trainer's"
    reader = speculators_reader(master)
    for req, ids in (("cmpl-a.1", [1, 2, 3]), ("7b", [4, 5, 6, 7, 8])):
        manifest = json.loads(_native.packed_manifest(req, len(ids), 2, H, "float32"))
        assert manifest["handle"] == {"cmpl-a.1": "cmpl-a_1", "7b": "k7b"}[req], "speculators' key of the request id"
        got = reader.get_sample(manifest, timeout=10)
        assert got["token_ids"].dtype == torch.int64 and got["token_ids"].tolist() == ids
        hs = got["hidden_states"]
        assert hs.dtype == torch.float32 and hs.shape == (len(ids), 2, H)
        assert hs[:, 1, 0].tolist() == [v + 100 for v in hs[:, 0, 0].tolist()], "slot 1 = slot 0 + 100 (rows_tagged)"
        reader.delete_sample(manifest["handle"])
    with pytest.raises(TimeoutError):  # deleted: a second read waits for an object that is gone, never stale bytes
        reader.get_sample(json.loads(_native.packed_manifest("7b", 5, 2, H, "float32")), timeout=0.3)
    s.finish()


def test_a_dead_master_fails_the_capture_naming_mooncake_s_code(master):
    s = session(store(master))
    master.kill()
    run(s, sched(new=[new_req("r1", [1, 2, 3], None)], n={"r1": 3}), ["r1"], rows_tagged)
    t = time.monotonic()
    with pytest.raises(OutputError, match=r"sample r1 was not stored: Mooncake put of r1 .*status -9\d\d") as e:
        s.drain()
    assert "r1:error" in str(e.value) and time.monotonic() - t < 60
    with pytest.raises(OutputError, match="not stored"):  # the capture stays failed
        run(s, sched(new=[new_req("r2", [1], None)], n={"r2": 1}), ["r2"], rows_tagged)


class FakeClient:
    """Answers put with the codes it is given, then 0."""

    def __init__(self, codes):
        self.codes, self.calls = list(codes), 0

    def upsert_from(self, key, address, size, *config):
        self.calls += 1
        return self.codes.pop(0) if self.codes else 0


def fake_store(codes, timeout):
    st = mooncake.Store(mooncake.settings({"put_timeout_s": timeout}, "test"))
    st.client = FakeClient(codes)
    return st


def test_a_full_store_makes_a_put_wait_then_fail_with_what_to_do():
    st = fake_store([-200, -200], timeout=5)
    st.put("k", 1, 10)
    assert st.client.calls == 3, "retried while the store had no room"
    st = fake_store([-200] * 1000, timeout=0.2)
    with pytest.raises(OutputError, match=r"status -200 \(NO_AVAILABLE_HANDLE.*waited 0.2 s for room"):
        st.put("k", 1, 10)
    st = fake_store([-800], timeout=5)
    with pytest.raises(OutputError, match=r"TRANSFER_FAIL.*check the master"):
        st.put("k", 1, 10)
    assert st.client.calls == 1, "only a full store is waited for"


@pytest.mark.parametrize(
    "given,match",
    [
        ({"master": "x"}, r"unknown keys \['master'\]"),
        ({"protocol": "udp"}, 'expected "tcp" or "rdma"'),
        ({"global_segment_size": "4GB"}, "global_segment_size"),
        ({"put_timeout_s": -1}, "put_timeout_s"),
        ([1], "expected a mapping"),
    ],
)
def test_settings_are_checked(given, match):
    with pytest.raises(ConfigError, match=match):
        mooncake.settings(given, "mooncake")


def test_no_master_is_a_config_error_naming_the_address(tmp_path):
    os.environ.update(mm.CLIENT_ENV)
    port = mm.free_port()
    st = mooncake.Store(
        mooncake.settings(
            {
                "master_server_address": f"127.0.0.1:{port}",
                "local_hostname": "127.0.0.1",
                "global_segment_size": 1 << 20,
            },
            "t",
        )
    )
    with pytest.raises(ConfigError, match=f"expected a master at 127.0.0.1:{port}"):
        st.open()
