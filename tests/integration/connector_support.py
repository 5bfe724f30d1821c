"""What the KV-connector tests share: the tiny model's serving arguments, speculators 0.9.0's location, a server
with hscapture's connector, speculators' own CLI, hscapture's offline capture of the same dataset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from server import Server

from hscapture import runtime_env

LAYERS = [1, 2, 4]  # vLLM's (before) ids; 4 = the tiny llama's depth: the final layer
ROWS = 22
VLLM_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--max-num-batched-tokens", "32"]
# One request per step: the server computes exactly the offline run's steps, so their states are equal bit for bit
# (float32 sums on CPU depend on how a step is composed; chunks of one request are the same in both runs).
SEQUENTIAL = ["--max-num-seqs", "1"]


def speculators() -> Path:
    from support import speculators_path

    p = speculators_path("0.9.0")
    if p is None or not (p / "hs_connectors").is_dir():
        pytest.skip("speculators 0.9.0 + hs-connectors 0.9.0 are not installed in <venv>/speculators-0.9.0")
    return p


def connector(stage: Path, fmt: str, mooncake: dict | None = None) -> str:
    """The connector's --kv-transfer-config: files under ``stage``, or with ``mooncake`` objects in that store."""
    where = {"mooncake": mooncake} if mooncake is not None else {"shared_storage_path": str(stage)}
    return json.dumps(
        {
            "kv_connector": "HscaptureConnector",
            "kv_connector_module_path": "hscapture.connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"format": fmt, **where},
        }
    )


def serve(
    tmp: Path,
    model: str,
    fmt: str,
    tp: int = 1,
    worker: str = "hscapture.worker.CaptureWorker",
    env=None,
    extra=(),
    mooncake: dict | None = None,
    stage: Path | None = None,
):
    """The issue's command as written: layers in additional_config, the connector's settings in its extra config;
    the files under ``stage`` (``tmp/stage-<format>-tp<tp>`` by default)."""
    stage = stage or tmp / f"stage-{fmt}-tp{tp}"
    args = [*VLLM_ARGS, *extra, "--worker-cls", worker, "--tensor-parallel-size", str(tp)]
    args += ["--additional-config", json.dumps({"hscapture": {"layers": LAYERS, "convention": "before"}})]
    args += ["--kv-transfer-config", connector(stage, fmt, mooncake)]
    if tp > 1:
        args += ["--distributed-executor-backend", "mp"]
    # The client here never retries (`--max-retries 0`) and waits for each file's lock between its requests: a
    # pooled connection idle for the server's keep-alive (vLLM's default 5 s) can be closed as it is reused, which
    # fails the run with a connection error that no retrying client would see.
    env = {**runtime_env.cpu_defaults(tp), "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "120", **(env or {})}
    return Server(tmp, model, *args, env=env, name=f"serve-{fmt}-tp{tp}"), stage


def generate(server: Server, data: Path, out: Path, validate: bool, *extra: str) -> subprocess.CompletedProcess:
    """speculators 0.9.0's `generate-offline-data`, unchanged."""
    cmd = [sys.executable, "-c", "import sys; from speculators.__main__ import app; sys.argv[0] = 'speculators'; app()"]
    cmd += ["generate-offline-data", "--endpoint", server.base + "/v1", "--preprocessed-data", str(data)]
    cmd += ["--output", str(out), "--concurrency", "4", "--max-retries", "0", "--fail-on-error", *extra]
    cmd += ["--validate-outputs"] if validate else []
    env = {**os.environ, "PYTHONPATH": str(speculators())}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def client_failure(r: subprocess.CompletedProcess) -> str:
    """What a failed client run said: its lines that name an error (a traceback's cause sits far above its tail),
    then the tails of its output."""
    named = [ln.strip() for ln in r.stderr.splitlines() if "Error" in ln or "Exception" in ln][:20]
    return "\n".join(named) + "\n--- stdout ---\n" + r.stdout[-2000:] + "\n--- stderr ---\n" + r.stderr[-3000:]


def extract(model: str, data: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hscapture.cli.main", "extract", "--model", model, "--input", str(data)]
    cmd += ["--out", str(out), "--layers", ",".join(map(str, LAYERS)), "--convention", "before"]
    cmd += ["--dtype", "float32", "--max-num-batched-tokens", "32", *extra]
    return subprocess.run(cmd, capture_output=True, text=True)


def hscapture_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hscapture.cli.main", *map(str, args)], capture_output=True, text=True)


def load(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))
