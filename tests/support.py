"""Helpers shared by every test suite (importable as `support`: tests/ is on sys.path via conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("HSCAPTURE_CACHE") or Path.home() / ".cache" / "hscapture")


def venv_dir() -> Path:
    import sys

    return Path(sys.prefix)


def speculators_path(version: str) -> Path | None:
    """Where scripts/setup.sh installed speculators ``version`` (``--no-deps``, its own folder)."""
    p = venv_dir() / f"speculators-{version}"
    return p if p.is_dir() else None
