"""Online capture: `vllm serve MODEL --worker-cls hscapture.worker.CaptureWorker --additional-config
'{"hscapture": {...}}'`. Each finished request's prompt states land in the output directory keyed by request
id, atomically, and `records.jsonl` (the journal) lists each file once it is complete."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import prompts

from hscapture import load_sample

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_vllm_serve_captures_each_request(tmp_path, tiny_model):
    model = tiny_model("llama", "float32")
    out, port = tmp_path / "online", _free_port()
    cfg = {"hscapture": {"layers": [0, 2], "convention": "after", "out": str(out), "durable": True}}
    vllm_cli = Path(sys.executable).with_name("vllm")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "TORCHINDUCTOR_VEC_ISA_OK": "1"}
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [
            str(vllm_cli),
            "serve",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--no-enable-prefix-caching",
            "--max-model-len",
            "128",
            "--max-num-batched-tokens",
            "32",
            "--worker-cls",
            "hscapture.worker.CaptureWorker",
            "--additional-config",
            json.dumps(cfg),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    pytest.fail("the server did not start:\n" + (tmp_path / "server.log").read_text()[-3000:])
                time.sleep(2)
        ps = prompts(seed=9, lengths=(5, 40, 77))  # 40 and 77 tokens span several 32-token steps
        ids = []
        for p in ps:
            r = _post(base + "/v1/completions", {"model": model, "prompt": p, "max_tokens": 1})
            ids.append(r["id"])
        journal = out / "records.jsonl"
        deadline = time.time() + 60
        while not journal.exists() or len(journal.read_text().splitlines()) < 1 + len(
            ps
        ):  # the identity, then a line each
            assert time.time() < deadline, f"journal has {journal.read_text() if journal.exists() else 'nothing'}"
            time.sleep(0.5)
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
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
