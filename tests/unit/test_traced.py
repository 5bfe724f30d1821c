"""Capture under torch.compile: the hooks traced into a full graph call hscapture's ops with each call's
tensors; a capture that is over leaves the ops doing nothing; what cannot be captured compiled is refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_hooks import Model

from hscapture import CompatibilityError, traced
from hscapture.hooks import install, install_positions_probe
from hscapture.vllm_compat import compiled


def _traced_model(seen: list, counts: list):
    m = Model(3)
    owner = traced.register(lambda slot, h, r: seen.append((slot, (h if r is None else h + r).clone())),
                            lambda p: counts.append(int(p.shape[-1])))
    install(m.model.layers, [("layer_output", 0), ("embeddings", 0), ("layer_output", 2)],
            lambda slot, h, r, owner=owner: traced.tap(h, r, slot, owner))
    install_positions_probe(m.model.layers, lambda p, owner=owner: traced.positions(p, owner))
    return m, owner


class Positioned(torch.nn.Module):
    """The toy model, passing positions to its layers as vLLM's models do."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, positions):
        h, r = x, None
        for layer in self.inner.model.layers:
            h, r = layer(positions, h, r)
        return h + r


@pytest.mark.parametrize("backend", ["aot_eager"])  # inductor: the integration test (vLLM compiles with it)
def test_hooks_traced_into_a_full_graph_see_every_calls_tensors(backend):
    seen, counts = [], []
    m, owner = _traced_model(seen, counts)
    fn = torch.compile(Positioned(m), fullgraph=True, backend=backend)  # a graph break would raise
    for scale in (1.0, 2.0):
        x = torch.arange(12, dtype=torch.float32).reshape(4, 3) * scale
        fn(x, torch.arange(4))
    assert [s for s, _ in seen] == [1, 0, 2, 1, 0, 2]  # the embeddings slot is read before layer 0 runs
    x1 = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    torch.testing.assert_close(seen[0][1], x1)  # embeddings: the input, no residual yet
    torch.testing.assert_close(seen[3][1], 2 * x1)  # the second call's tensors, not the first's
    torch.testing.assert_close(seen[1][1], torch.zeros(4, 3) + x1)  # layer 0's output: 0 + residual x
    assert counts == [4, 4]
    assert traced.calls(owner) == 6
    traced.unregister(owner)
    fn(x1, torch.arange(4))  # the graph still calls the ops; they do nothing now
    assert len(seen) == 6 and traced.calls(owner) == 9


def test_an_unknown_owner_is_refused_with_what_to_do():
    traced.ensure_ops()
    with pytest.raises(CompatibilityError, match="no longer registered"):
        torch.ops.hscapture.tap(torch.zeros(2, 2), None, 0, 10**9)


def _cfg(mode, cudagraphs="NONE", device="cpu"):
    cg = SimpleNamespace(name=cudagraphs)
    return SimpleNamespace(compilation_config=SimpleNamespace(mode=mode, cudagraph_mode=cg),
                           device_config=SimpleNamespace(device_type=device))


def test_which_compilation_modes_are_captured():
    assert compiled(_cfg(0)) is False
    assert compiled(_cfg(0, "PIECEWISE", "cuda")) is False  # eager: vLLM never replays graphs then
    assert compiled(_cfg(2)) is True  # the CPU platform's DYNAMO_TRACE_ONCE
    assert compiled(_cfg(3)) is True
    with pytest.raises(CompatibilityError, match="CUDA graphs"):
        compiled(_cfg(3, "FULL_AND_PIECEWISE", "cuda"))
    with pytest.raises(CompatibilityError, match="CUDA graphs"):
        compiled(_cfg(3, "PIECEWISE", "cpu"))
    with pytest.raises(CompatibilityError, match="verified on vLLM's CPU platform only"):
        compiled(_cfg(3, "NONE", "cuda"))
