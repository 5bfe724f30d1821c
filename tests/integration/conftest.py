"""Integration tests: real vLLM on CPU, real tiny models, real files, HF transformers as the oracle."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="integration tests need vLLM (run scripts/setup.sh)")

HERE = Path(__file__).resolve().parent

# Workers are spawned processes: let them import the test-only worker classes in this folder.
os.environ["PYTHONPATH"] = str(HERE) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
