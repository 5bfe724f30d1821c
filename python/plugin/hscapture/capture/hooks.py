"""Hooks on a model's decoder layers: where each layer slot's tensor is taken.

- ``("layer_output", k)``: a forward hook on decoder layer ``k``; the layer returns a tensor (the stream) or
  ``(hidden_states, residual)``: their sum for vLLM's fused-residual layers, ``hidden_states`` alone for layers that
  return the stream whole (``adapters/layer_output.py`` tells which from the layer's forward), read before the next
  layer's fused add-norm overwrites them in place.
- ``("embeddings", 0)``: a forward pre-hook on layer 0 reading its ``hidden_states`` argument (plus
  ``residual`` if one is passed: vLLM passes none to layer 0).

Under torch.compile the same hooks are traced into the graph; the callbacks they get then call the
custom ops of ``traced.py`` (see there).

No model's forward is copied: whatever a model computes between layers (DeepSeek's
``llama_4_scaling``, Gemma's embedding scale) is already in what the layers see.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..adapters import layer_output
from ..errors import CompatibilityError, ShapeContractError

Capture = Callable[[int, torch.Tensor, "torch.Tensor | None"], None]


_EMBEDDINGS = ("embed_tokens", "wte", "word_embeddings", "tok_embeddings", "embeddings")


def _language_model(model: torch.nn.Module) -> tuple[str, torch.nn.Module]:
    """The text model of a multimodal model, through vLLM's own interface (``get_language_model()``, which its
    multimodal models implement), with its name inside ``model``; the model itself otherwise."""
    get = getattr(model, "get_language_model", None)
    if callable(get):
        try:
            lm = get()
        except Exception:  # noqa: BLE001 - an interface vLLM's model did not fill in: search the whole model
            lm = None
        if isinstance(lm, torch.nn.Module) and lm is not model:
            for name, mod in model.named_modules():
                if mod is lm:
                    return name, lm
    return "", model


def find_decoder_layers(model: torch.nn.Module, num_hidden_layers: int) -> tuple[str, torch.nn.ModuleList]:
    """The ``nn.ModuleList`` of decoder layers, found through the model's structure rather than by counting: inside
    the text model of a multimodal model (so a vision tower of the same depth is never taken), a list of the text
    model's depth named ``layers``/``h``/``blocks``, preferring the one beside the token embeddings, then the
    shortest name."""
    prefix, root = _language_model(model)
    found = [
        (name, mod)
        for name, mod in root.named_modules()
        if isinstance(mod, torch.nn.ModuleList)
        and len(mod) == num_hidden_layers
        and name.split(".")[-1] in ("layers", "h", "blocks")
    ]
    if not found:
        lists = [f"{n} ({len(m)})" for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)][:8]
        inside = f" (its text model {prefix!r}, from get_language_model())" if prefix else ""
        raise CompatibilityError(
            f"cannot find the decoder layers of {type(model).__name__}{inside}: expected an nn.ModuleList named "
            f"`layers` with {num_hidden_layers} entries (the text config's num_hidden_layers), found module lists "
            f"{lists or 'none'}"
        )
    modules = dict(root.named_modules())

    def beside_embeddings(name: str) -> bool:
        parent = modules.get(name.rpartition(".")[0])
        return parent is not None and any(hasattr(parent, e) for e in _EMBEDDINGS)

    found.sort(key=lambda nm: (not beside_embeddings(nm[0]), nm[0].count("."), len(nm[0])))
    name, layers = found[0]
    return (f"{prefix}.{name}" if prefix else name), layers


def is_missing(layer: torch.nn.Module) -> bool:
    """Whether a decoder-layer slot is a placeholder for a layer owned by another pipeline stage."""
    return type(layer).__name__ == "PPMissingLayer"


def _arg_index(layer: torch.nn.Module, name: str) -> int | None:
    try:
        params = list(inspect.signature(layer.forward).parameters)
    except (TypeError, ValueError):
        return None
    return params.index(name) if name in params else None


def _split_output(out: Any, where: str, add_residual: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer's output as (hidden, residual to add or None)."""
    if isinstance(out, torch.Tensor):
        return out, None
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        res = out[1] if add_residual and len(out) > 1 and isinstance(out[1], torch.Tensor) else None
        return out[0], res
    raise ShapeContractError(
        f"{where} returned {type(out).__name__}; expected a tensor or a (hidden_states, residual) tuple of tensors"
    )


def install(
    layers: torch.nn.ModuleList, points: list[tuple[str, int]], capture: Capture, output: str = "auto"
) -> list[Any]:
    """Registers one hook per slot; returns the handles (``handle.remove()`` undoes them). ``output``: the
    ``layer_output`` setting (``auto``: each layer's rule read from its forward)."""
    handles = []
    for slot, (kind, k) in enumerate(points):
        layer = layers[k]
        if is_missing(layer):
            continue  # owned by another pipeline stage
        where = f"decoder layer {k} ({type(layer).__name__})"
        if kind == "layer_output":
            add = layer_output.rule_for(layer, output) == "sum"

            def post(_mod, _args, out, slot=slot, where=where, add=add):
                h, r = _split_output(out, where, add)
                capture(slot, h, r)

            handles.append(layer.register_forward_hook(post))
        elif kind == "embeddings":
            hi, ri = _arg_index(layer, "hidden_states"), _arg_index(layer, "residual")
            if hi is None:
                raise CompatibilityError(f"{where}: forward() has no `hidden_states` argument; cannot read its input")

            def pre(_mod, args, kwargs, slot=slot, hi=hi, ri=ri, where=where):
                h = kwargs.get("hidden_states", args[hi] if hi < len(args) else None)
                r = kwargs.get("residual", args[ri] if ri is not None and ri < len(args) else None)
                if not isinstance(h, torch.Tensor):
                    raise ShapeContractError(f"{where}: input hidden_states is {type(h).__name__}, expected a tensor")
                capture(slot, h, r if isinstance(r, torch.Tensor) else None)

            handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        else:
            raise CompatibilityError(f"unknown capture point {kind!r}")
    return handles


def install_positions_probe(layers: torch.nn.ModuleList, seen: Callable[[torch.Tensor], None]) -> list[Any]:
    """A pre-hook on the first decoder layer this rank runs, handing over its ``positions`` (their last
    dimension is how many tokens the forward runs, padding included: what a sharded residual stream was
    split from). No hook if the layer takes no ``positions`` (the step's scheduled count is used instead)."""
    for layer in layers:
        if is_missing(layer):
            continue
        pi = _arg_index(layer, "positions")
        if pi is None:
            return []

        def pre(_mod, args, kwargs, pi=pi):
            p = kwargs.get("positions", args[pi] if pi < len(args) else None)
            if isinstance(p, torch.Tensor):
                seen(p)

        return [layer.register_forward_pre_hook(pre, with_kwargs=True)]
    return []
