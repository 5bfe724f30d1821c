"""hscapture: capture intermediate-layer hidden states from vLLM prefill as EAGLE-3 training data.

The worker class for vLLM is ``hscapture.worker.CaptureWorker`` (imported lazily: it needs vLLM).
"""

from . import errors
from ._native import __version__
from .errors import *  # noqa: F401,F403  (the exception tree)
from .output.io import load_manifest, load_sample

__all__ = ["__version__", *errors.__all__, "load_sample", "load_manifest"]
