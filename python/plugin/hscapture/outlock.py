"""One run per output directory: an advisory lock (``OUT/.hscapture.lock``, flock) held for the run.

A second run on the same directory fails at once with ``OutputError`` naming the holder, instead of
two writers racing over the same files and manifest. The lock dies with its process (a killed run
leaves no stale lock)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .errors import OutputError

NAME = ".hscapture.lock"


class OutputLock:
    def __init__(self, out: str | Path) -> None:
        self.path = Path(out) / NAME
        self._fd: int | None = None

    def acquire(self) -> "OutputLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OutputError(
                f"another hscapture run (pid {holder}) is writing {self.path.parent}; wait for it to finish or choose "
                "another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
