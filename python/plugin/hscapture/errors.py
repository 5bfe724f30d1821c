"""hscapture's exception tree (defined in Rust, ``hscapture._native``).

``HscaptureError`` is the base of ``ConfigError``, ``ShapeContractError`` (and its subclasses
``NonFiniteError`` and ``DegenerateStatesError``), ``AttributionError``, ``RankMismatchError``, ``OutputError`` and
``CompatibilityError``, ``PeerFailedError`` (another rank failed; its own error is the cause) and
``EngineDiedError`` (vLLM's engine process died while a run waited for it). Every
message names what was expected, what was found and what to do.
"""

from ._native import (  # noqa: F401
    AttributionError,
    CompatibilityError,
    ConfigError,
    DegenerateStatesError,
    EngineDiedError,
    HscaptureError,
    NonFiniteError,
    OutputError,
    PeerFailedError,
    RankMismatchError,
    ShapeContractError,
)

__all__ = [
    "HscaptureError",
    "ConfigError",
    "ShapeContractError",
    "NonFiniteError",
    "DegenerateStatesError",
    "AttributionError",
    "RankMismatchError",
    "OutputError",
    "CompatibilityError",
    "PeerFailedError",
    "EngineDiedError",
]
