"""Online capture: `vllm serve MODEL --worker-cls hscapture.worker.CaptureWorker --additional-config
'{"hscapture": {...}}'`. Each finished request's prompt states land in the output directory keyed by request
id, atomically, and `records.jsonl` (the journal) lists each file once it is complete."""

from __future__ import annotations

import json
import time

import pytest
from helpers import prompts
from server import Server

from hscapture import load_sample

pytestmark = [pytest.mark.integration, pytest.mark.newest]


def test_vllm_serve_captures_each_request(tmp_path, tiny_model):
    model = tiny_model("llama", "float32")
    out = tmp_path / "online"
    cfg = {"hscapture": {"layers": [0, 2], "convention": "after", "out": str(out), "durable": True}}
    args = ["--dtype", "float32", "--enforce-eager", "--no-enable-prefix-caching", "--max-model-len", "128"]
    args += ["--max-num-batched-tokens", "32", "--worker-cls", "hscapture.worker.CaptureWorker"]
    ps = prompts(seed=9, lengths=(5, 40, 77))  # 40 and 77 tokens span several 32-token steps
    journal = out / "records.jsonl"
    with Server(tmp_path, model, *args, "--additional-config", json.dumps(cfg)) as server:
        ids = [server.complete(p)["id"] for p in ps]
        deadline = time.time() + 60
        # The identity, then a line each.
        while not journal.exists() or len(journal.read_text().splitlines()) < 1 + len(ps):
            assert time.time() < deadline, f"journal has {journal.read_text() if journal.exists() else 'nothing'}"
            time.sleep(0.5)
    identity, *records = [json.loads(x) for x in journal.read_text().splitlines()]
    assert identity["identity"]["layer_ids"] == [0, 2] and identity["identity"]["format"] == "hscapture"
    assert len(records) == len(ps) and all("request_id" in r and "index" not in r for r in records)
    by_tokens = {}
    for r in records:
        s = load_sample(out / r["file"])
        assert r["file"] == f"hidden_states/hs_req-{r['request_id']}.safetensors"
        assert tuple(s["hidden_states"].shape)[1:] == (2, 128) and r["length"] == s["hidden_states"].shape[0]
        by_tokens[tuple(s["token_ids"].tolist())] = r
    assert set(by_tokens) == {tuple(p) for p in ps}, "every request's prompt, each once"
    # Each request id the server answered with is the prefix of the id its file carries.
    assert all(any(r["request_id"].startswith(i) or i in r["request_id"] for r in records) for i in ids), (ids, records)
    assert not [f for f in (out / "hidden_states").iterdir() if ".partial" in f.name]
