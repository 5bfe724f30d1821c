"""GPU tests: skipped where CUDA is not available (run them on the H200: docs/benchmarks.md). They are still
collected everywhere, so that CI imports every module of this suite (`pytest --collect-only tests/gpu` in
scripts/test.sh; the names imported inside test functions are checked by tests/unit/test_gpu_suite.py)."""

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="CUDA is not available here")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)
