"""Typed errors across the process boundary.

A worker that raises an ``HscaptureError`` kills vLLM's engine, and the driver only sees
``EngineDeadError``. The worker therefore also leaves the error in ``OUT/.hscapture-errors/rank{r}.json``;
the driver re-raises it with its own type (``raise_recorded``).
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import _native, errors

DIR = ".hscapture-errors"


def record_failure(out: str | None, rank: int, e: BaseException) -> None:
    """Records a rank's first error (the root cause; what fails after it is a consequence). An error that
    only says another rank failed (``PeerFailedError``) is not recorded: that rank's own error is."""
    if not out or isinstance(e, errors.PeerFailedError):
        return
    try:
        d = Path(out) / DIR
        d.mkdir(parents=True, exist_ok=True)
        if (d / f"rank{rank}.json").exists():
            return
        record = json.dumps({"type": type(e).__name__, "message": str(e), "rank": rank}).encode()
        _native.write_file(str(d / f"rank{rank}.json"), record, False)
    except (OSError, errors.HscaptureError):
        pass  # the original error is still raised; this file is a convenience


def clear(out: str | Path) -> None:
    d = Path(out) / DIR
    if d.is_dir():
        for f in d.iterdir():
            f.unlink(missing_ok=True)
        d.rmdir()


def raise_recorded(out: str | Path, cause: BaseException | None = None) -> None:
    """Raises the first worker error recorded under ``out`` (lowest rank), chained to ``cause``; returns if none.
    Also called after a run vLLM reported as finished: an engine may go on after a worker's error."""
    d = Path(out) / DIR
    files = (
        sorted(d.glob("rank*.json"), key=lambda p: int(p.stem[4:]) if p.stem[4:].isdigit() else 1 << 30)
        if d.is_dir()
        else []
    )
    for f in files:
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        cls = getattr(errors, rec.get("type", ""), errors.HscaptureError)
        if not (isinstance(cls, type) and issubclass(cls, errors.HscaptureError)):
            cls = errors.HscaptureError
        raise cls(f"{rec.get('message')} [raised by the worker of rank {rec.get('rank')}]") from cause
