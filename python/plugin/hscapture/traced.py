"""Capture under torch.compile: the layer hooks call two custom ops instead of Python.

Dynamo traces a decoder layer's forward hooks into the compiled graph (hooks registered before the first
forward, which is where vLLM compiles). A hook whose body calls hscapture's session would break the graph
(vLLM compiles with ``fullgraph``) or be traced once with the warm-up's tensors. So when vLLM compiles, the
hooks call ``hscapture::tap`` (a slot's hidden states and residual) and ``hscapture::positions`` (how many
tokens the forward runs): opaque to the compiler, run at every forward with that forward's tensors, and
marked as having side effects so that dead-code elimination keeps them although they return nothing.

Each op carries an ``owner`` number baked into the graph: the capture of this worker process that
registered it (``register``); the op's implementation calls that capture's Python callbacks with the tensors, exactly as
the eager hooks do.
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional

import torch

from .errors import CompatibilityError

_OWNERS: dict[int, tuple[Callable, Callable]] = {}
_CALLS: dict[int, int] = {}  # how often the compiled graph called `tap` for each owner (the report shows it)
_NEXT = itertools.count(1)
_REGISTERED = False


def _define() -> None:
    @torch.library.custom_op("hscapture::tap", mutates_args=())
    def tap(hidden: torch.Tensor, residual: Optional[torch.Tensor], slot: int, owner: int) -> None:
        _CALLS[owner] = _CALLS.get(owner, 0) + 1
        _owner(owner)[0](slot, hidden, residual)

    @tap.register_fake
    def _tap_fake(hidden, residual, slot, owner):  # noqa: ARG001 - the signature is the op's
        return None

    @torch.library.custom_op("hscapture::positions", mutates_args=())
    def positions(positions: torch.Tensor, owner: int) -> None:
        _owner(owner)[1](positions)

    @positions.register_fake
    def _positions_fake(positions, owner):  # noqa: ARG001
        return None

    for op in (torch.ops.hscapture.tap.default, torch.ops.hscapture.positions.default):
        torch.fx.node.has_side_effect(op)


def ensure_ops() -> None:
    """Defines the ops once per process; a torch without what they need is refused here, at start-up."""
    global _REGISTERED
    if _REGISTERED:
        return
    missing = [name for name, ok in (("torch.library.custom_op", hasattr(torch.library, "custom_op")),
                                     ("torch.fx.node.has_side_effect", hasattr(torch.fx.node, "has_side_effect"))) if not ok]
    if missing:
        raise CompatibilityError(
            f"capturing under torch.compile needs {' and '.join(missing)}, which torch {torch.__version__} lacks; "
            "start vLLM with enforce_eager=True (`--enforce-eager`)"
        )
    _define()
    _REGISTERED = True


def _owner(owner: int) -> tuple[Callable, Callable]:
    found = _OWNERS.get(owner)
    if found is None:
        raise CompatibilityError(
            f"a compiled graph called hscapture's op for capture #{owner}, which is no longer registered in this "
            f"process (registered: {sorted(_OWNERS) or 'none'}); the model was compiled by another capture session — "
            "restart the engine"
        )
    return found


def register(capture: Callable, positions: Callable) -> int:
    """A number for the graph to carry; the ops call ``capture(slot, hidden, residual)`` and
    ``positions(positions_tensor)``."""
    ensure_ops()
    owner = next(_NEXT)
    _OWNERS[owner] = (capture, positions)
    return owner


def _nothing(*_args) -> None:
    return None


def unregister(owner: int) -> None:
    """The capture is over; the compiled graph still calls the ops (the hooks cannot be taken out of it),
    so they now do nothing."""
    if owner in _OWNERS:
        _OWNERS[owner] = (_nothing, _nothing)


def calls(owner: int) -> int:
    """How many times a compiled graph has called ``hscapture::tap`` for this capture (warm-up included)."""
    return _CALLS.get(owner, 0)


def calls(owner: int) -> int:
    """How many times a compiled graph has called ``hscapture::tap`` for this capture (warm-up included)."""
    return _CALLS.get(owner, 0)


def tap(hidden: torch.Tensor, residual: torch.Tensor | None, slot: int, owner: int) -> None:
    torch.ops.hscapture.tap(hidden, residual, slot, owner)


def positions(p: torch.Tensor, owner: int) -> None:
    torch.ops.hscapture.positions(p, owner)
