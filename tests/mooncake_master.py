"""A Mooncake master on loopback for tests: free ports, started as a subprocess, ready once its RPC port accepts,
stopped (SIGKILL on request: a master that dies mid-run) at the end. Clients in the test's processes need
``CLIENT_ENV`` before their first set-up: TCP advertised on 127.0.0.1 (not the first LAN address), a missing
master noticed in seconds."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CLIENT_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_STORE_CLIENT_SETUP_RETRIES": "2", "MC_RPC_TIMEOUT_MS": "5000"}


def available() -> str | None:
    """Why Mooncake cannot run here, or None when its client imports and its master exists."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return f"Mooncake's client does not import ({e}); scripts/setup.sh installs mooncake-transfer-engine-non-cuda"
    return None if executable() else "mooncake_master is not installed beside this Python"


def executable() -> str | None:
    beside = Path(sys.executable).with_name("mooncake_master")
    return str(beside) if beside.exists() else shutil.which("mooncake_master")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Master:
    address: str
    process: subprocess.Popen

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()


@contextlib.contextmanager
def master(log: Path, timeout: float = 20.0) -> Iterator[Master]:
    rpc = free_port()
    args = [executable() or "mooncake_master", "-rpc_address=127.0.0.1", f"-rpc_port={rpc}"]
    args += ["-metrics_host=127.0.0.1", f"-metrics_port={free_port()}", "-rpc_thread_num=2"]
    args += ["-enable_metric_reporting=false"]
    with log.open("w") as out:
        p = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **CLIENT_ENV})
        m = Master(f"127.0.0.1:{rpc}", p)
        try:
            deadline = time.time() + timeout
            while True:
                try:
                    socket.create_connection(("127.0.0.1", rpc), 0.2).close()
                    break
                except OSError:
                    if p.poll() is not None or time.time() > deadline:
                        raise RuntimeError(f"mooncake_master did not start:\n{log.read_text()[-2000:]}") from None
                    time.sleep(0.05)
            yield m
        finally:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    m.kill()
