"""The driver and its engine live and die together.

- The engine dies with its driver: ``hscapture extract`` marks the processes vLLM starts for it
  (``HSCAPTURE_DRIVER_PID``), and hscapture's vLLM plugin, which vLLM loads in each of them, asks the kernel
  to kill each one when its parent dies (``PR_SET_PDEATHSIG``). An engine process can no longer outlive a
  driver killed with SIGKILL and go on writing files after the output directory's lock was released.
- The driver fails when its engine dies: vLLM's client waits for the engine's next output without a timeout,
  so a dead engine (the OOM killer, a crash) left the driver waiting forever. :class:`Watchdog` watches the
  engine's processes and interrupts the driver's wait with :class:`~hscapture.EngineDiedError`, naming the
  process and how it ended.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from typing import Any

from .errors import EngineDiedError

log = logging.getLogger("hscapture")
MARK = "HSCAPTURE_DRIVER_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> bool:
    """In a process started for an hscapture driver: dies (SIGKILL) when its parent does. True if set."""
    driver = os.environ.get(MARK)
    if not driver or str(os.getpid()) == driver:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):  # not Linux: nothing to set
        return False
    if os.getppid() == 1:  # the parent died before the request reached the kernel
        os._exit(1)
    return True


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is gone"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def engine_processes(llm: Any) -> list:
    """The engine's processes vLLM started for ``llm`` (multiprocessing ``Process`` objects; none when the
    engine runs in this process)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    manager = getattr(getattr(core, "resources", None), "engine_manager", None)
    return [p for p in getattr(manager, "processes", None) or [] if hasattr(p, "sentinel")]


class Watchdog:
    """While active (a ``with`` block on the driver's main thread), a thread waits on the engine processes'
    sentinels; when one ends, the main thread's wait is interrupted (a signal to this process, whose handler
    raises :class:`EngineDiedError`). Without processes to watch, or off the main thread, it does nothing."""

    SIGNAL = signal.SIGUSR1

    def __init__(self, processes: list) -> None:
        self.processes = processes
        self.died: str | None = None
        self._stop = threading.Event()
        self._r, self._w = os.pipe()
        self._old: Any = None
        self._thread: threading.Thread | None = None

    def _handler(self, signum, frame) -> None:  # noqa: ARG002 - a signal handler's signature
        if self.died is not None and not self._stop.is_set():
            raise EngineDiedError(self.died)

    def _watch(self) -> None:
        import multiprocessing.connection

        sentinels = {p.sentinel: p for p in self.processes}
        ready = multiprocessing.connection.wait([*sentinels, self._r])
        if self._stop.is_set() or self._r in ready:
            return
        p = sentinels[next(s for s in ready if s in sentinels)]
        self._reaped(p)
        self.died = (
            f"vLLM's engine process {p.name} (pid {p.pid}) {describe_exit(p.exitcode)} while the capture was running; "
            "expected it to run until the last request finished. The OOM killer, or a crash logged above, ends an "
            "engine this way: check `dmesg` and the log, then re-run with --resume (finished samples are kept)"
        )
        log.error("hscapture: %s", self.died)
        os.kill(os.getpid(), self.SIGNAL)

    @staticmethod
    def _reaped(p, limit_s: float = 3.0) -> None:
        """Waits until ``p.exitcode`` is known. vLLM's own liveness monitor polls the same process: when its
        ``waitpid`` wins the race ours fails and ``exitcode`` stays None until that thread stores the status."""
        deadline = time.monotonic() + limit_s
        while p.exitcode is None and time.monotonic() < deadline:
            p.join(0.05)

    def __enter__(self) -> Watchdog:
        if self.processes and threading.current_thread() is threading.main_thread():
            self._old = signal.signal(self.SIGNAL, self._handler)
            self._thread = threading.Thread(target=self._watch, name="hscapture-engine-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        os.write(self._w, b"x")
        if self._thread is not None:
            self._thread.join(5)
            signal.signal(self.SIGNAL, self._old)
        os.close(self._r)
        os.close(self._w)
