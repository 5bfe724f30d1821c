"""One run per output directory: an advisory lock (``OUT/.hscapture.lock``, flock) held for the run.

A second run on the same directory fails at once with ``OutputError`` naming the holder, instead of
two writers racing over the same files and manifest. The lock dies with its process (a killed run
leaves no stale lock). Having it, the run also waits (briefly) for ``OUT/.hscapture.writer.lock``,
which the process writing the files holds while it may write: an engine of an earlier run that has
not died yet cannot add a file once this run owns the directory."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from .. import _native
from ..errors import OutputError

NAME = ".hscapture.lock"
WRITER = _native.WRITER_LOCK  # the core's writer lock (output/sinks/dirlock.rs)
WRITER_WAIT_S = 30.0


class OutputLock:
    def __init__(self, out: str | Path) -> None:
        self.path = Path(out) / NAME
        self._fd: int | None = None
        self._made_dir = False

    def acquire(self) -> OutputLock:
        d = self.path.parent
        try:
            self._made_dir = not d.exists()
            d.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            what = "is a file, not a directory" if d.exists() and not d.is_dir() else f"cannot be used ({e.strerror})"
            raise OutputError(
                f"the output directory {d} {what}; choose a directory you can write (it is created if missing)"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OutputError(
                f"another hscapture run (pid {holder}) is writing {d}; wait for it to finish or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        try:
            self._wait_for_writer()
        except BaseException:
            self.release()
            raise
        return self

    def _wait_for_writer(self) -> None:
        """Waits until no process holds the directory's writer lock (an earlier run's engine, dying)."""
        path = self.path.parent / WRITER
        if not path.exists():
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            deadline = time.monotonic() + WRITER_WAIT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    return
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                        raise OutputError(
                            f"process {holder} still writes into {self.path.parent} (an engine of an earlier run that "
                            f"outlived its driver?); expected none after {WRITER_WAIT_S:.0f} s: stop it, then re-run"
                        ) from None
                    time.sleep(0.1)
        finally:
            os.close(fd)

    def release(self) -> None:
        if self._fd is None:
            return
        d = self.path.parent
        # A run that stopped before writing anything leaves no lock file (and no directory it made).
        if {p.name for p in d.iterdir()} <= {NAME}:
            self.path.unlink(missing_ok=True)
            if self._made_dir:
                try:
                    d.rmdir()
                except OSError:
                    pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
