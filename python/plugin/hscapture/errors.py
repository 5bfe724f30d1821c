"""hscapture's exception tree (defined in Rust, ``hscapture._native``).

``HscaptureError`` is the base of ``ConfigError``, ``ShapeContractError`` (and its subclass
``NonFiniteError``), ``AttributionError``, ``RankMismatchError``, ``OutputError`` and
``CompatibilityError``, and ``PeerFailedError`` (another rank failed; its own error is the cause). Every
message names what was expected, what was found and what to do.
"""

from ._native import (  # noqa: F401
    AttributionError,
    CompatibilityError,
    ConfigError,
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
    "AttributionError",
    "RankMismatchError",
    "OutputError",
    "CompatibilityError",
    "PeerFailedError",
]
