"""Online training without a disk in between: an hscapture server (``--kv-transfer-config`` format ``mooncake``)
puts each request's states into a Mooncake store started here on loopback, and speculators 0.9.0's own online data
path — ``ArrowDataset`` with ``MooncakeTransfer``, asking the server for every sample it misses — reads them. Its
samples must equal hscapture's offline capture bit for bit (one request per step, as the offline run computes
them). A master that dies mid-run ends in failed requests and Mooncake's code in the server's log, not a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error

import pytest
import torch
from connector_support import SEQUENTIAL, load, serve, speculators

import mooncake_master as mm

pytestmark = [pytest.mark.integration, pytest.mark.skipif(mm.available() is not None, reason=str(mm.available()))]

ONLINE = """
import json, sys, torch
from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig
from hs_connectors.transfer import MooncakeTransfer
from speculators.train.data import ArrowDataset
data, endpoint, master, model, out = sys.argv[1:6]
store = MooncakeHiddenStatesStore(MooncakeStoreConfig(local_hostname="127.0.0.1", master_server_address=master,
                                                      global_segment_size=256 << 20, local_buffer_size=64 << 20))
ds = ArrowDataset(max_len=256, datapath=data, transfer=MooncakeTransfer(store), vllm_endpoint=endpoint,
                  on_missing="generate", model=model, hidden_states_dtype=torch.float32)
items = [ds[i] for i in range(len(ds))]
torch.save([dict(it) if isinstance(it, dict) else repr(it) for it in items], out)
print("READ", len(items))
"""


READ_ONE = """
import json, sys
from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig
master, manifest = sys.argv[1], json.loads(sys.argv[2])
store = MooncakeHiddenStatesStore(MooncakeStoreConfig(local_hostname="127.0.0.1", master_server_address=master,
                                                      global_segment_size=0, local_buffer_size=16 << 20)).setup()
print("GOT", store.get_sample(manifest, timeout=30)["token_ids"].tolist())
"""


def read_one(master, manifest: dict) -> subprocess.CompletedProcess:
    """speculators' reader, in its own process: the object of `manifest`'s token ids."""
    cmd = [sys.executable, "-c", READ_ONE, master.address, json.dumps(manifest)]
    return subprocess.run(cmd, capture_output=True, text=True, env=client_env(), timeout=300)


def store_settings(master) -> dict:
    """The server's Mooncake block: speculators' names; a small segment of its own for this test."""
    return {
        "master_server_address": master.address,
        "local_hostname": "127.0.0.1",
        "global_segment_size": 256 << 20,
        "local_buffer_size": 16 << 20,
    }


def client_env() -> dict:
    return {**os.environ, **mm.CLIENT_ENV, "PYTHONPATH": str(speculators())}


@pytest.mark.newest
def test_speculators_online_training_reads_the_server_s_objects(prepared, tmp_path):
    model, root, data, ids, offline = prepared
    with mm.master(tmp_path / "master.log") as master:
        server, _ = serve(
            tmp_path, model, "mooncake", extra=SEQUENTIAL, env=mm.CLIENT_ENV, mooncake=store_settings(master)
        )
        out = tmp_path / "online.pt"
        with server:
            cmd = [sys.executable, "-c", ONLINE, str(data), server.base + "/v1", master.address, model, str(out)]
            r = subprocess.run(cmd, capture_output=True, text=True, env=client_env(), timeout=900)
            assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:] + server.log()
            probe = server.complete(ids[2])["kv_transfer_params"]
            # Prompt and response in one pass: the object holds every token through a forward.
            body = {"model": model, "prompt": ids[3], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
            body |= {"return_token_ids": True, "kv_transfer_params": {"include_output_tokens": True}}
            status, answer = server.post("/v1/completions", body)
            assert status == 200, answer
            generated, manifest = answer["choices"][0]["token_ids"], answer["kv_transfer_params"]
            assert manifest["metadata"]["extract_mode"] == "all"
            r = read_one(master, manifest)
            assert r.returncode == 0 and f"GOT {ids[3] + generated[:-1]}" in r.stdout, r.stdout + r.stderr[-3000:]
    items = torch.load(out, weights_only=True)
    assert len(items) == len(ids)
    for i, (item, row) in enumerate(zip(items, ids, strict=True)):
        assert isinstance(item, dict), f"sample {i} unavailable to the trainer: {item}"
        ref = load(offline / "hidden_states" / f"hs_{i}.safetensors")["hidden_states"]  # [T, 3, 128] float32
        assert item["input_ids"].tolist() == row
        assert torch.equal(item["hidden_states"], ref[:, :-1].flatten(1)), f"sample {i}: aux layers"
        assert torch.equal(item["verifier_last_hidden_states"], ref[:, -1]), f"sample {i}: the final layer"
    # The answer is speculators' transfer manifest: version 1, the key, the packed layout.
    assert probe["version"] == 1 and probe["metadata"]["extract_mode"] == "prompt_only"
    assert probe["tensors"]["hidden_states"] == {
        "shape": [len(ids[2]), 3, 128],
        "dtype": "torch.float32",
        "nbytes": len(ids[2]) * 3 * 128 * 4,
        "offset": 0,
    }


def test_a_master_that_dies_ends_in_failed_requests_and_a_clear_error(prepared, tmp_path):
    model, root, data, ids, offline = prepared
    with mm.master(tmp_path / "master.log") as master:
        server, _ = serve(tmp_path, model, "mooncake", env=mm.CLIENT_ENV, mooncake=store_settings(master))
        with server:
            manifest = server.complete(ids[0])["kv_transfer_params"]
            r = read_one(master, manifest)
            assert r.returncode == 0 and f"GOT {ids[0]}" in r.stdout, r.stderr[-3000:]
            master.kill()
            t, answers, body = time.time(), [], {}
            while time.time() - t < 120:
                try:
                    status, body = server.post("/v1/completions", {"model": model, "prompt": ids[1], "max_tokens": 1})
                except urllib.error.URLError:  # the engine died and took the server with it
                    status = "refused"
                answers.append(status)
                if status != 200:
                    break
                time.sleep(0.5)
            assert answers[-1] != 200, f"the server kept answering after its store's master died: {answers}"
            assert "kv_transfer_params" not in json.dumps(body), body
            log = server.log()
    assert "Mooncake put of" in log and "status -90" in log, log


def test_the_server_refuses_to_start_without_its_master(prepared, tmp_path):
    model, *_ = prepared
    dead = {"master_server_address": f"127.0.0.1:{mm.free_port()}", "local_hostname": "127.0.0.1"}
    server, _ = serve(tmp_path, model, "mooncake", env=mm.CLIENT_ENV, mooncake={**dead, "global_segment_size": 1 << 24})
    try:
        server.proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        server.stop()
        pytest.fail("the server kept running without a Mooncake master")
    server.stop()
    log = server.log_path.read_text(errors="replace")
    assert "ConfigError" in log and f"expected a master at {dead['master_server_address']}" in log, log[-4000:]
