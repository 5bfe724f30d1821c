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


@pytest.fixture
def engine(request, monkeypatch) -> bool:
    """Parametrized with ``engines.ENGINES`` (``indirect``): sets the runner; returns whether vLLM runs with its
    defaults (compiled, CUDA graphs) rather than eager."""
    runner, defaults = request.param
    if runner == "v1":
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    else:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setenv("HSCAPTURE_DEVICE_PATH", "required")
    return defaults
