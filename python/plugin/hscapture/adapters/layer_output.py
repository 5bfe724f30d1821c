"""What a decoder layer hands on as the residual stream, read from its own ``forward``.

vLLM's decoder layers follow one of two conventions:

- **fused residual** (Llama, Qwen, DeepSeek, Mixtral, Gemma 2/3, GPT-OSS, most others): ``forward(positions,
  hidden_states, residual)`` reads the residual it is given (its first norm adds it, fused) and returns
  ``(hidden_states, residual)`` whose *sum* is the stream the next layer reads: ``sum``.
- **whole stream** (Command-R/Cohere, Exaone 4, Granite 4 hybrid, PhiMoE, StableLM, HyperCLOVA X, Gemma 4, MiniCPM,
  and HF's own layers under vLLM's Transformers backend): the layer adds its residual itself and returns the stream as
  its first output; the second, where there is one, is an intermediate (the stream before the MLP) that the next layer
  never reads, since it begins with ``residual = hidden_states``. Summing the two would store the stream plus a stale
  copy of itself: ``hidden``.

A model's layers hand each other what they read, so the rule is read from the hooked layer's own ``forward``
(its class's source, through ``ast``): ``sum`` when it takes a ``residual`` argument and may read it before
assigning it (an ``assert`` aside), ``hidden`` when it takes none or overwrites it first. A forward whose source
cannot be read, or whose first use of ``residual`` is none of these (an assignment inside a branch, ``del``), is
refused by name at start-up unless the ``layer_output`` setting says which.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any

from ..errors import CompatibilityError, ConfigError

RULES = ("sum", "hidden")
SETTINGS = ("auto", *RULES)
_SET = 'set layer_output (additional_config["hscapture"]["layer_output"], HSCAPTURE_LAYER_OUTPUT or --layer-output) to'


def _mentions(node: ast.AST, name: str) -> list[ast.Name]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Name) and n.id == name]


def _first_use(body: list[ast.stmt], name: str) -> str | None:
    """How the function body first uses ``name``: ``"read"`` (a statement that may read it before any assignment),
    ``"assigned"`` (a statement at the top of the body that assigns it from an expression not reading it), ``"unclear"``
    (any other first mention: an assignment inside a branch, a loop target, ``del``...), or None (never used).
    An ``assert`` computes nothing the layer returns: it is passed over."""
    for stmt in body:
        uses = _mentions(stmt, name)
        if not uses or isinstance(stmt, ast.Assert):
            continue
        if isinstance(stmt, ast.AugAssign) or any(isinstance(u.ctx, ast.Load) for u in uses):
            return "read"  # `if residual is None`, `norm(x, residual)`, `residual += x`, ...
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None and not _mentions(stmt.value, name):
            return "assigned"
        return "unclear"
    return None


@functools.cache
def _rule_of_class(cls: type) -> tuple[str | None, str]:
    """(rule or None if it cannot be told, why) for a decoder-layer class, from the forward it runs."""
    fn = inspect.unwrap(getattr(cls, "forward", None))
    owner = getattr(fn, "__qualname__", "forward")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None, f"{owner} has no signature hscapture can read"
    if "residual" not in params:
        if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values()):
            return None, f"{owner} takes *args and no named residual, so whether it is given one is unknown"
        return "hidden", f"{owner} takes no residual: what it returns first is the stream"
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None, f"the source of {owner} cannot be read, so whether it reads its residual argument is unknown"
    node = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if node is None:
        return None, f"the source of {owner} is not a function definition"
    use = _first_use(node.body, "residual")
    if use == "read":
        return "sum", f"{owner} reads the residual it is given: the stream is hidden_states + residual"
    if use in ("assigned", None):
        return "hidden", f"{owner} overwrites its residual argument before reading it: it returns the stream whole"
    return None, (
        f"{owner} first uses its residual argument in a statement hscapture does not read (an assignment inside a "
        "branch or loop, `del`, ...)"
    )


def rule_for(layer: Any, setting: str = "auto") -> str:
    """``sum`` or ``hidden`` for a decoder layer (an ``nn.Module``): ``setting`` unless it is ``auto``."""
    if setting not in SETTINGS:
        raise ConfigError(f"layer_output={setting!r} is not valid; expected one of {', '.join(SETTINGS)}")
    if setting != "auto":
        return setting
    rule, why = _rule_of_class(type(layer))
    if rule is None:
        raise CompatibilityError(
            f"cannot tell what decoder layer {type(layer).__name__} hands on as its output: {why}. Expected a forward "
            f"that reads the residual it is given (vLLM's fused residual: the output is hidden_states + residual) or "
            f"one that overwrites it first (the output is hidden_states alone); {_SET} `sum` or `hidden`, "
            f"whichever this model's layers follow"
        )
    return rule
