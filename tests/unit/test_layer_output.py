"""What a decoder layer hands on as its output (adapters/layer_output.py): hidden_states + residual for vLLM's
fused-residual layers, hidden_states alone for layers that return the stream whole; read from the layer's forward,
checked here on layers written both ways, on vLLM's own layer classes, and through the hooks."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch

from hscapture.adapters import layer_output
from hscapture.capture import hooks
from hscapture.errors import CompatibilityError, ConfigError


class Fused(torch.nn.Module):
    """Llama's shape: reads the residual it is given; the stream is the sum of what it returns."""

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
        else:
            residual = residual + hidden_states
        return hidden_states * 2, residual


class FusedInNorm(torch.nn.Module):
    """Reads its residual inside the statement that also assigns it (the right side runs first)."""

    def norm(self, h, r):
        return h, h + r

    def forward(self, positions, hidden_states, residual):
        hidden_states, residual = self.norm(hidden_states, residual)
        return hidden_states, residual


class Whole(torch.nn.Module):
    """Command-R's shape: overwrites its residual argument, returns the stream and a stale intermediate."""

    def forward(self, positions, hidden_states, residual):
        residual = hidden_states
        hidden_states = residual + 1.0
        return hidden_states, residual


class WholeAfterOtherWork(torch.nn.Module):
    """Exaone 4's shape: other statements first, then the overwrite."""

    def forward(self, positions, hidden_states, residual):
        scale = 1.0
        residual: torch.Tensor = hidden_states
        return hidden_states + scale, residual


class AssertsThenWhole(torch.nn.Module):
    """An assert reads nothing into the output: the overwrite after it decides."""

    def forward(self, positions, hidden_states, residual):
        assert residual is None or residual.shape == hidden_states.shape
        residual = hidden_states
        return hidden_states + 1.0, residual


class AddsFirst(torch.nn.Module):
    def forward(self, positions, hidden_states, residual):
        residual += hidden_states
        return hidden_states, residual


class Deletes(torch.nn.Module):
    def forward(self, positions, hidden_states, residual):
        del residual
        return hidden_states, None


class NoResidual(torch.nn.Module):
    """StableLM's shape: takes no residual, returns (stream, intermediate)."""

    def forward(self, positions, hidden_states):
        residual = hidden_states
        return hidden_states + 1.0, residual


class Unused(torch.nn.Module):
    def forward(self, positions, hidden_states, residual=None):
        return hidden_states + 1.0, None


class Branchy(torch.nn.Module):
    def forward(self, positions, hidden_states, residual):
        if positions is None:
            residual = hidden_states
        return hidden_states, residual


class Args(torch.nn.Module):
    def forward(self, *args):
        return args[1], args[2]


class NoSource(torch.nn.Module):
    pass


exec("def _forward(self, positions, hidden_states, residual):\n    return hidden_states, residual\n", globals())
NoSource.forward = _forward  # type: ignore[name-defined]  # noqa: F821 - defined by exec, no source file


@pytest.mark.parametrize(
    "cls,rule",
    [
        (Fused, "sum"),
        (FusedInNorm, "sum"),
        (AddsFirst, "sum"),
        (Whole, "hidden"),
        (AssertsThenWhole, "hidden"),
        (WholeAfterOtherWork, "hidden"),
        (NoResidual, "hidden"),
        (Unused, "hidden"),
    ],
)
def test_the_rule_is_read_from_the_forward(cls, rule):
    assert layer_output.rule_for(cls()) == rule


@pytest.mark.parametrize("cls", [Branchy, Deletes, Args, NoSource])
def test_a_forward_that_cannot_be_read_is_refused_unless_the_setting_says(cls):
    with pytest.raises(CompatibilityError, match=f"{cls.__name__}.*layer_output"):
        layer_output.rule_for(cls())
    assert layer_output.rule_for(cls(), "sum") == "sum"
    assert layer_output.rule_for(cls(), "hidden") == "hidden"


def test_an_unknown_setting_is_refused():
    with pytest.raises(ConfigError, match="auto, sum, hidden"):
        layer_output.rule_for(Fused(), "first")


class Stack(torch.nn.Module):
    def __init__(self, cls):
        super().__init__()
        self.layers = torch.nn.ModuleList([cls() for _ in range(2)])


@pytest.mark.parametrize("cls,expected", [(Fused, 2 * 3.0 + 3.0), (Whole, 3.0 + 1.0), (NoResidual, 3.0 + 1.0)])
def test_the_hook_captures_what_the_layer_hands_on(cls, expected):
    """Through hooks.install: the sum for a fused layer, the first output alone for the others."""
    model = Stack(cls)
    got = {}
    handles = hooks.install(model.layers, [("layer_output", 0)], lambda s, h, r: got.update(h=h, r=r))
    x = torch.full((2, 4), 3.0)
    if cls is NoResidual:
        model.layers[0](None, x)
    else:
        model.layers[0](None, x, None)
    for h in handles:
        h.remove()
    value = got["h"] + (got["r"] if got["r"] is not None else 0)
    assert torch.equal(value, torch.full((2, 4), expected))


def test_the_embeddings_slot_asks_no_rule():
    """Layer 0's input is read by a pre-hook whatever the layer returns: a layer hscapture cannot read is not refused
    for it."""
    model = Stack(Branchy)
    got = {}
    handles = hooks.install(model.layers, [("embeddings", 0)], lambda s, h, r: got.update(h=h, r=r))
    model.layers[0](None, torch.ones(2, 4), None)
    for h in handles:
        h.remove()
    assert got["r"] is None and torch.equal(got["h"], torch.ones(2, 4))


def _decoder_layer_classes():
    """Every layer class of vLLM's model definitions (named ``*Layer`` or ``*Block``, defining a forward that takes
    ``hidden_states``: decoder layers, GPT-2's and Bloom's blocks, and their kin), where its module imports here."""
    models = pytest.importorskip("vllm.model_executor.models")
    found = []
    for info in pkgutil.iter_modules(models.__path__):
        try:
            mod = importlib.import_module(f"{models.__name__}.{info.name}")
        except Exception:  # noqa: BLE001 - a model needing a package or a device this machine lacks
            continue
        for obj in vars(mod).values():
            if isinstance(obj, type) and issubclass(obj, torch.nn.Module) and obj.__module__ == mod.__name__:
                fwd = obj.__dict__.get("forward")
                named = obj.__name__.endswith(("Layer", "Block")) or "DecoderLayer" in obj.__name__
                if fwd is not None and named and "hidden_states" in inspect.signature(fwd).parameters:
                    found.append(obj)
    return found


def test_every_decoder_layer_of_this_vllm_is_read():
    """Each decoder-layer class vLLM defines gets a rule (none refused), and the well-known families the one their
    source shows: a new vLLM whose layers hscapture cannot read fails here, not on a user's model."""
    classes = {c.__name__: c for c in _decoder_layer_classes()}
    assert {"LlamaDecoderLayer", "Qwen2DecoderLayer", "CohereDecoderLayer", "StablelmDecoderLayer"} <= set(classes)
    refused = {}
    for name, c in classes.items():
        rule, why = layer_output._rule_of_class(c)
        if rule is None:
            refused[name] = why
    assert not refused, refused
    expect = {
        "LlamaDecoderLayer": "sum",
        "Qwen2DecoderLayer": "sum",
        "DeepseekV2DecoderLayer": "sum",
        "MixtralDecoderLayer": "sum",
        "Gemma2DecoderLayer": "sum",
        "CohereDecoderLayer": "hidden",
        "Exaone4DecoderLayer": "hidden",
        "StablelmDecoderLayer": "hidden",
        "PhiMoEDecoderLayer": "hidden",
        "GraniteMoeHybridAttentionDecoderLayer": "hidden",
    }
    for name, rule in expect.items():
        if name in classes:
            assert layer_output._rule_of_class(classes[name])[0] == rule, name
