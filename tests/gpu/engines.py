"""How vLLM runs in the GPU tests: its defaults (torch.compile and CUDA graphs, FULL_AND_PIECEWISE) on its default
model runner first, then eager on the same runner, then the V1 runner under the defaults where this vLLM still has it
(0.34 removed it). Used with the ``engine`` fixture (conftest.py), ``indirect``."""

from __future__ import annotations

import importlib.util

import pytest


def has_v1_runner() -> bool:
    """Whether this vLLM still has the V1 model runner."""
    try:
        return importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None
    except (ImportError, ValueError):
        return False


ENGINES = [
    pytest.param(("default", True), id="defaults"),
    pytest.param(("default", False), id="eager"),
    pytest.param(("v1", True), id="v1-defaults", marks=pytest.mark.skipif(not has_v1_runner(), reason="no V1 runner")),
]
