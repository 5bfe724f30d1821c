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
    install(m.model.layers, [("layer_output", 0), ("embeddings", 0), ("layer_output", 2)],
            lambda slot, h, r: traced.tap(h, r, slot))
    install_positions_probe(m.model.layers, traced.positions)
    traced.activate(lambda slot, h, r: seen.append((slot, (h if r is None else h + r).clone())),
                    lambda p: counts.append(int(p.shape[-1])))
    return m


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
    m = _traced_model(seen, counts)
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
    assert traced.calls() == 6
    with pytest.raises(CompatibilityError, match="already active"):
        traced.activate(print, print)
    traced.deactivate()
    fn(x1, torch.arange(4))  # the graph still calls the ops; with no capture active they do nothing
    assert len(seen) == 6 and traced.calls() == 6


def test_speculators_rpc_setup_is_refused_once_the_model_is_compiled():
    from hscapture.rpc import HiddenStatesRPC

    worker = HiddenStatesRPC()
    worker.vllm_config = _cfg(2)
    with pytest.raises(CompatibilityError, match="compiled the model"):
        worker._setup_hidden_states_capture([1, 2])


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
