"""A real ``vllm serve`` on loopback for the online tests: started in its own process group, waited for on
``/health``, stopped with SIGINT (SIGKILL after a minute), its log shown when it fails."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

# VLLM_SLEEP_WHEN_IDLE: on 2 cores, TP workers that spin while idle starve the client process (speculators' CLI
# took over 10 minutes to import beside a TP=2 server).
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "TORCHINDUCTOR_VEC_ISA_OK": "1",
    "VLLM_SLEEP_WHEN_IDLE": "1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp_path: Path, model: str, *args: str, env: dict | None = None, name: str = "server"):
        self.port, self.model, self.log_path = free_port(), model, tmp_path / f"{name}.log"
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [
            str(Path(sys.executable).with_name("vllm")),
            "serve",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            cmd + [str(a) for a in args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **ENV, **(env or {})},
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float = 300) -> Server:
        deadline = time.time() + timeout
        while True:
            try:
                urllib.request.urlopen(self.base + "/health", timeout=5)
                return self
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.stop()
                    pytest.fail("the server did not start:\n" + self.log())
                time.sleep(1)

    def post(self, path: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
        """(HTTP status, JSON body) of a POST."""
        req = urllib.request.Request(
            self.base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                return e.code, json.loads(text)
            except ValueError:
                return e.code, {"text": text}

    def complete(self, prompt: list[int]) -> dict:
        status, body = self.post("/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": 1})
        assert status == 200, (status, body)
        return body

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> Server:
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()
