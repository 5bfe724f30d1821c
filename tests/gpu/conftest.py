"""GPU tests: skipped as a whole where CUDA is not available; run on the H200 (see docs/benchmarks.md)."""

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("CUDA is not available here", allow_module_level=True)
