"""Capture under torch.compile: the layer hooks call two custom ops instead of Python.

Dynamo traces a decoder layer's forward hooks into the compiled graph (hooks registered before the first
forward, which is where vLLM compiles). A hook whose body calls hscapture's session would break the graph
(vLLM compiles with ``fullgraph``) or be traced once with the warm-up's tensors. So when vLLM compiles, the
hooks call ``hscapture::tap`` (a slot's hidden states and residual) and ``hscapture::positions`` (the
forward's positions, whose length a sharded residual stream was split from): opaque to the compiler, run at
every forward with that forward's tensors, and marked as having side effects, because AOTAutograd and
inductor remove an op that returns nothing otherwise.

Nothing specific to a process is baked into the graph, only each tap's slot and capture point (the core's point
code: ``k`` for the output of decoder layer ``k``, -1 for the embeddings): vLLM may load a compiled graph from its
cache in a later process, keyed by a hash of the configuration. The ops call the one capture *active* in this
process, whose core checks each tap's point against its own settings (a graph cached by a run with other settings is
refused, not trusted); a graph that outlives its capture (the hooks cannot be taken out of it) then does nothing.
Whether a tap is given the layer's residual (``adapters/layer_output.py``) is baked into the graph and not carried by
the tap: it is put in the configuration vLLM hashes for its compile cache instead (``wiring.py``), with the points.

Under CUDA graphs the ops' Python runs when vLLM captures a graph (and for batches no graph covers); what the
capture needs at every replay is the device launch it made then (``worker_capture.py``, ``cuda/mod.rs``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import CompatibilityError

_ACTIVE: tuple[Callable, Callable] | None = None
_DEFINED = False


def _define() -> None:
    @torch.library.custom_op("hscapture::tap", mutates_args=())
    def tap(hidden: torch.Tensor, residual: torch.Tensor | None, slot: int, point: int) -> None:
        if _ACTIVE is not None:
            _ACTIVE[0](slot, point, hidden, residual)

    @tap.register_fake
    def _tap_fake(hidden, residual, slot, point):  # noqa: ARG001 - the signature is the op's
        return None

    @torch.library.custom_op("hscapture::positions", mutates_args=())
    def positions(positions: torch.Tensor) -> None:
        if _ACTIVE is not None:
            _ACTIVE[1](positions)

    @positions.register_fake
    def _positions_fake(positions):  # noqa: ARG001
        return None

    for op in (torch.ops.hscapture.tap.default, torch.ops.hscapture.positions.default):
        torch.fx.node.has_side_effect(op)


def ensure_ops() -> None:
    """Defines the ops once per process; a torch without what they need is refused here, at start-up."""
    global _DEFINED
    if _DEFINED:
        return
    missing = [
        name
        for name, ok in (
            ("torch.library.custom_op", hasattr(torch.library, "custom_op")),
            ("torch.fx.node.has_side_effect", hasattr(torch.fx.node, "has_side_effect")),
        )
        if not ok
    ]
    if missing:
        raise CompatibilityError(
            f"capturing under torch.compile needs {' and '.join(missing)}, which torch {torch.__version__} lacks; "
            "start vLLM with enforce_eager=True (`--enforce-eager`)"
        )
    _define()
    _DEFINED = True


def activate(capture: Callable, positions: Callable) -> None:
    """From now on the ops call ``capture(slot, point, hidden, residual)`` and ``positions(positions_tensor)``."""
    global _ACTIVE
    ensure_ops()
    if _ACTIVE is not None:
        raise CompatibilityError(
            "expected no other capture under torch.compile in this process, found one still active (an engine in this "
            "process that has not finished: its `hscapture_finish` was not called); finish it first, or run each "
            "capturing engine in its own process"
        )
    _ACTIVE = (capture, positions)


def deactivate() -> None:
    """The capture is over; compiled graphs still call the ops, which now do nothing."""
    global _ACTIVE
    _ACTIVE = None


def tap(hidden: torch.Tensor, residual: torch.Tensor | None, slot: int, point: int) -> None:
    torch.ops.hscapture.tap(hidden, residual, slot, point)


def positions(p: torch.Tensor) -> None:
    torch.ops.hscapture.positions(p)
