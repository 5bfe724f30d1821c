"""Shared fixtures: tiny models (built once per cache), vLLM's CPU environment, the reference."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    return Path(os.environ.get("HSCAPTURE_CACHE") or Path.home() / ".cache" / "hscapture")


@pytest.fixture(scope="session")
def tiny_model():
    """Builds (or reuses) a tiny model: ``tiny_model("llama")`` -> its directory."""
    from hscapture import tiny

    def get(kind: str) -> str:
        return str(tiny.build(kind, cache_dir() / "models" / f"tiny-{kind.replace('_', '-')}", seed=0))

    return get
