"""Shared fixtures: tiny models (built once per cache), vLLM's CPU environment, the reference."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `support`, whichever suite runs first
from support import cache_dir  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model():
    """Builds (or reuses) a tiny model: ``tiny_model("llama")`` -> its directory."""
    from hscapture.testing import tiny

    def get(kind: str, dtype: str = "bfloat16") -> str:
        import transformers

        suffix = "" if dtype == "bfloat16" else f"-{dtype}"
        # One copy per transformers major version: 5.x writes tokenizer files 4.x cannot load, and the two
        # test environments (vLLM 0.16 with 4.57, the newest with 5.x) share the cache.
        tf = f"-tf{transformers.__version__.split('.')[0]}"
        return str(
            tiny.build(kind, cache_dir() / "models" / f"tiny-{kind.replace('_', '-')}{suffix}{tf}", seed=0, dtype=dtype)
        )

    return get
