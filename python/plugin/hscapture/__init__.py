"""hscapture: capture intermediate-layer hidden states from vLLM prefill as EAGLE-3 training data.

The worker class for vLLM is ``hscapture.worker.CaptureWorker`` (imported lazily: it needs vLLM).
"""

from ._native import __version__
from .errors import (
    AttributionError,
    CompatibilityError,
    ConfigError,
    HscaptureError,
    NonFiniteError,
    OutputError,
    RankMismatchError,
    ShapeContractError,
)
from .io import load_manifest, load_sample

__all__ = [
    "__version__",
    "HscaptureError",
    "ConfigError",
    "ShapeContractError",
    "NonFiniteError",
    "AttributionError",
    "RankMismatchError",
    "OutputError",
    "CompatibilityError",
    "load_sample",
    "load_manifest",
]
