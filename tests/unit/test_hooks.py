"""Hooks on decoder layers: where slots are read."""

import pytest
import torch

from hscapture import CompatibilityError
from hscapture.capture.hooks import find_decoder_layers, install


class Layer(torch.nn.Module):
    """vLLM-style: returns (hidden_states, residual) with a fused residual."""

    def __init__(self, k):
        super().__init__()
        self.k = k

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
        else:
            residual = residual + hidden_states
        return torch.full_like(hidden_states, float(self.k)), residual


class Model(torch.nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([Layer(k) for k in range(n)])
        self.other = torch.nn.ModuleList([torch.nn.Identity()] * n)

    def forward(self, x):
        h, r = x, None
        for layer in self.model.layers:
            h, r = layer(None, h, r)
        return h + r


def test_finds_the_layers_list():
    name, layers = find_decoder_layers(Model(), 3)
    assert name == "model.layers" and len(layers) == 3
    with pytest.raises(CompatibilityError, match="cannot find the decoder layers"):
        find_decoder_layers(Model(), 5)


class _Text(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(4, 2)
        self.model.layers = torch.nn.ModuleList([Layer(k) for k in range(n)])


class _Vision(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Identity() for _ in range(n)])


class Qwen2VL(torch.nn.Module):
    """vLLM's Qwen2-VL layout: `visual.blocks` and `language_model.model.layers`, here of the same depth."""

    def __init__(self, n, interface=True):
        super().__init__()
        self.visual = _Vision(n)
        self.language_model = _Text(n)
        if interface:
            self.get_language_model = lambda: self.language_model


class KimiK25(torch.nn.Module):
    """Kimi-K2.5's layout: `vision_tower.encoder.blocks` beside `language_model.model.layers`."""

    def __init__(self, n):
        super().__init__()
        self.vision_tower = torch.nn.Module()
        self.vision_tower.encoder = _Vision(n)
        self.language_model = _Text(n)

    def get_language_model(self):
        return self.language_model


@pytest.mark.parametrize(
    "model", [Qwen2VL(4), Qwen2VL(4, interface=False), KimiK25(4)], ids=["qwen2vl", "no-api", "kimi"]
)
def test_a_vision_tower_of_the_same_depth_is_not_taken_for_the_text_model(model):
    name, layers = find_decoder_layers(model, 4)
    assert name == "language_model.model.layers" and layers is model.language_model.model.layers


def test_the_text_model_s_depth_is_looked_for_inside_the_text_model():
    with pytest.raises(CompatibilityError, match="its text model 'language_model'"):
        find_decoder_layers(KimiK25(4), 6)


def test_points_read_sum_of_outputs_and_embeddings():
    m = Model()
    got = {}
    install(
        m.model.layers,
        [("embeddings", 0), ("layer_output", 1)],
        lambda slot, h, r: got.__setitem__(slot, h if r is None else h + r),
    )
    x = torch.full((2, 4), 10.0)
    m(x)
    assert torch.equal(got[0], x)
    # residual after layer 1 = x + 0 (layer 0's output); layer 1's output = 1 -> 10 + 0 + 1
    assert torch.equal(got[1], torch.full((2, 4), 11.0))
