"""The speculators-compatible RPC surface, without an engine: real Rust session, vLLM-shaped steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_session import H, rows_tagged

from hscapture import AttributionError, ConfigError, ShapeContractError, _native
from hscapture.adapters.vllm_compat import RunnerOrder
from hscapture.capture.ranksync import RankSync
from hscapture.capture.worker_capture import WorkerCapture
from hscapture.config import CaptureConfig
from hscapture.rpc import HiddenStatesRPC
from support import new_req, sched


class Runner:
    def __init__(self):
        self.input_batch = SimpleNamespace(num_reqs=0, req_ids=[])

    def lay_out(self, order):
        self.input_batch.num_reqs, self.input_batch.req_ids = len(order), list(order)


class Worker(HiddenStatesRPC):
    """What vLLM's worker is to the extension: an object with the RPC methods and a capture."""

    def __init__(self, layers=(1, 3), tp=None, rank=0, out=None):
        self.runner = Runner()
        session = _native.CaptureSession(list(layers), "after", 4, H, "float32", "float32", assemble=True)
        cfg = CaptureConfig(layers=tuple(layers), convention="after", out=out)
        sync = RankSync(tp or SimpleNamespace(size=1, rank=0), rank, out)
        self._hscapture = WorkerCapture(cfg, session, sync, RunnerOrder(self.runner))

    def step(self, so, order, values=rows_tagged):
        cap = self._hscapture
        self.runner.lay_out(order)
        cap.begin(so)
        for slot in range(len(cap.layer_ids)):
            h = values(slot, so.total_num_scheduled_tokens)
            cap.on_capture(slot, h, torch.zeros_like(h))
        cap.end()


def test_before_setup_every_call_is_a_typed_error():
    w = HiddenStatesRPC()
    for call in (
        w._reset_capture,
        w._get_captured_states,
        lambda: w._set_request_metadata({}),
        lambda: w._store_captured_states([]),
    ):
        with pytest.raises(ConfigError, match="_setup_hidden_states_capture"):
            call()


def two_steps(w, metadata: bool):
    """a (3 tokens) whole and b's first 2 of 5; then b's last 3 next to a decode token."""
    w._reset_capture()
    if metadata:
        w._set_request_metadata({"a": 3, "b": 2})
    w.step(
        sched(new=[new_req("a", [1, 2, 3], None), new_req("b", [4, 5, 6, 7, 8], None)], n={"a": 3, "b": 2}), ["b", "a"]
    )
    if metadata:
        w._set_request_metadata({"b": 3})
    w.step(sched(cached=[("a", 3), ("b", 2)], n={"a": 1, "b": 3}), ["a", "b"])


def test_metadata_drivers_get_a_dict_of_per_layer_tensors():
    w = Worker()
    two_steps(w, metadata=True)
    got = w._get_captured_states()
    assert sorted(got) == ["a", "b"]
    assert [t.shape for t in got["b"]] == [(5, H), (5, H)]
    # b's rows: step-1 rows 0..1, then step-2 rows 1..3 (row 0 was a's decode token)
    assert got["b"][0][:, 0].tolist() == [0.0, 1.0, 1.0, 2.0, 3.0]
    assert got["b"][1][:, 0].tolist() == [100.0, 101.0, 101.0, 102.0, 103.0]
    assert w._get_captured_states() is None, "collected samples are handed out once"


def test_drivers_without_metadata_get_one_tensor_per_layer_in_admission_order():
    w = Worker()
    two_steps(w, metadata=False)
    got = w._get_captured_states()
    assert isinstance(got, list) and [t.shape for t in got] == [(8, H), (8, H)]
    # a (admitted first) then b, each whole — though b's rows came first in step 1.
    assert got[0][:, 0].tolist() == [2.0, 3.0, 4.0, 0.0, 1.0, 1.0, 2.0, 3.0]


def test_a_capture_that_writes_its_samples_keeps_no_admission_order(tmp_path):
    """A server writes every sample and hands none to a driver: the ids of the requests it admitted are not kept (they
    would grow for as long as it runs); a capture that keeps its samples for a driver keeps them."""
    writes, keeps = Worker(out=str(tmp_path / "out")), Worker()
    for w in (writes, keeps):
        for k in range(50):
            rid = f"r{k}"
            w.step(sched(new=[new_req(rid, [1, 2, 3], None)], n={rid: 3}), [rid])
    assert writes._hscapture.rpc.admitted == [] and not writes._hscapture.rpc._admitted_set
    assert keeps._hscapture.rpc.admitted == [f"r{k}" for k in range(50)]
    writes._hscapture.close()


def test_metadata_that_disagrees_with_the_scheduler_is_refused():
    w = Worker()
    w._reset_capture()
    w._set_request_metadata({"a": 2})  # the driver thinks a contributes 2 tokens; the scheduler says 3
    with pytest.raises(AttributionError, match=r"a: hscapture 3, driver 2"):
        w.step(sched(new=[new_req("a", [1, 2, 3], None)], n={"a": 3}), ["a"])


def test_an_incomplete_request_is_refused_in_the_list_shape():
    w = Worker()
    w._reset_capture()
    w.step(sched(new=[new_req("a", [1, 2, 3], None), new_req("b", [4, 5, 6, 7], None)], n={"a": 3, "b": 2}), ["a", "b"])
    with pytest.raises(AttributionError, match=r"no complete states .*\['b'\]"):
        w._get_captured_states()


def test_store_captured_states_goes_through_the_contract():
    w = Worker()
    cap = w._hscapture
    with pytest.raises(AttributionError, match="outside a step"):
        w._store_captured_states([torch.zeros(3, H), torch.zeros(3, H)])
    w.runner.lay_out(["a"])
    cap.begin(sched(new=[new_req("a", [1, 2, 3], None)], n={"a": 3}))
    with pytest.raises(ShapeContractError, match="expected 2 tensors"):
        w._store_captured_states([torch.zeros(3, H)])
    rows = torch.arange(3 * H, dtype=torch.float32).reshape(3, H)  # a different row per token
    w._store_captured_states([rows, 2 * rows])
    cap.end()
    got = w._get_captured_states()
    assert got[1].tolist() == (2 * rows).tolist()
