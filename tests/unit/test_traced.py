"""Capture under torch.compile: the hooks traced into a full graph call hscapture's ops with each call's
tensors; a capture that is over leaves the ops doing nothing; what cannot be captured compiled is refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_hooks import Model

from hscapture import CompatibilityError, _native
from hscapture.adapters.vllm_compat import execution
from hscapture.capture import traced
from hscapture.capture.hooks import install, install_positions_probe

POINTS = [("layer_output", 0), ("embeddings", 0), ("layer_output", 2)]


def codes_of(points):
    """The point codes the core gives these points (a session whose slots are them, in the `before` convention)."""
    ids = [0 if kind == "embeddings" else k + 1 for kind, k in points]
    s = _native.CaptureSession(sorted(ids), "before", 4, 3, "float32", "float32", assemble=False)
    by_id = dict(zip(s.layer_ids, s.point_codes(), strict=True))
    return tuple(by_id[i] for i in ids)


@pytest.fixture
def active():
    """Activates a capture for the test; whatever happens, none is active after it."""
    yield traced.activate
    traced.deactivate()


def _traced_model(seen: list, counts: list, activate, points=POINTS):
    m = Model(3)
    codes = codes_of(points)
    install(m.model.layers, points, lambda slot, h, r: traced.tap(h, r, slot, codes[slot]))
    install_positions_probe(m.model.layers, traced.positions)
    activate(
        lambda slot, point, h, r: seen.append((slot, point, (h if r is None else h + r).clone())),
        lambda p: counts.append(int(p.shape[-1])),
    )
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
def test_hooks_traced_into_a_full_graph_see_every_calls_tensors(backend, active):
    seen, counts = [], []
    m = _traced_model(seen, counts, active)
    fn = torch.compile(Positioned(m), fullgraph=True, backend=backend)  # a graph break would raise
    for scale in (1.0, 2.0):
        x = torch.arange(12, dtype=torch.float32).reshape(4, 3) * scale
        fn(x, torch.arange(4))
    assert [(s, p) for s, p, _ in seen] == [
        (1, -1),
        (0, 0),
        (2, 2),
    ] * 2  # the embeddings slot is read before layer 0 runs
    x1 = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    torch.testing.assert_close(seen[0][2], x1)  # embeddings: the input, no residual yet
    torch.testing.assert_close(seen[3][2], 2 * x1)  # the second call's tensors, not the first's
    torch.testing.assert_close(seen[1][2], torch.zeros(4, 3) + x1)  # layer 0's output: 0 + residual x
    assert counts == [4, 4]
    with pytest.raises(CompatibilityError, match="still active"):
        traced.activate(print, print)
    traced.deactivate()
    fn(x1, torch.arange(4))  # the graph still calls the ops; with no capture active they do nothing
    assert len(seen) == 6


def test_point_codes_are_the_cores():
    assert codes_of(POINTS) == (0, -1, 2)


def test_a_graph_built_for_other_capture_points_is_refused():
    """vLLM's compile cache can hand a capture a graph traced with another capture's hooks: the taps carry
    their capture points, and a capture whose settings differ refuses them (a layer's states never land
    under another layer's id)."""
    from test_rpc import Worker

    cap = Worker(layers=(0, 2))._hscapture
    cap.on_traced(0, 0, torch.zeros(2, 8), None)  # its own point: fine (no step)
    with pytest.raises(CompatibilityError, match="taps the output of decoder layer 1 for layer id 0"):
        cap.on_traced(0, 1, torch.zeros(2, 8), None)  # outside a step (vLLM's start-up): raised at once


def test_finish_deactivates_and_reports_the_taps_of_captured_steps():
    """After `finish` the compiled graph's taps do nothing, so another capture in the process may start."""
    from test_rpc import Worker

    cap = Worker(layers=(0, 2))._hscapture
    traced.activate(cap.on_traced, cap.on_positions)
    cap.traced_points, cap.traced_active, cap.traced_taps = (0, 2), True, 7
    cap.out_dtype, cap.hidden_size, cap.num_hidden_layers = "float32", 8, 4
    try:
        assert cap.finish()["traced_calls"] == 7
        traced.activate(print, print)  # not refused: the finished capture is no longer active
    finally:
        traced.deactivate()


def test_speculators_rpc_setup_is_refused_once_the_model_is_compiled():
    from hscapture.rpc import HiddenStatesRPC

    worker = HiddenStatesRPC()
    worker.vllm_config = _cfg(2)
    with pytest.raises(CompatibilityError, match="compiled the model"):
        worker._setup_hidden_states_capture([1, 2])


def _cfg(mode, cudagraphs="NONE", device="cpu", parallel=None, **passes):
    cg = SimpleNamespace(name=cudagraphs)
    cc = SimpleNamespace(mode=mode, cudagraph_mode=cg, pass_config=SimpleNamespace(**passes))
    return SimpleNamespace(
        compilation_config=cc,
        device_config=SimpleNamespace(device_type=device),
        parallel_config=SimpleNamespace(**(parallel or {})),
    )


def test_how_vllm_runs_the_model_is_read_from_its_config():
    assert execution(_cfg(0)).compiled is False
    assert execution(_cfg(2)).compiled is True  # the CPU platform's DYNAMO_TRACE_ONCE
    assert execution(_cfg(3, "FULL_AND_PIECEWISE", "cuda")) == execution(_cfg(3, "FULL_AND_PIECEWISE", "cuda"))
    ex = execution(_cfg(3, "FULL_AND_PIECEWISE", "cuda"))
    assert (ex.compiled, ex.graphs) == (True, "FULL_AND_PIECEWISE")
    assert "cudagraph_mode FULL_AND_PIECEWISE" in ex.describe()
    assert execution(_cfg(0, "FULL", "cuda")).graphs == "FULL"  # graphs of the eager model: hooks recorded too
    assert execution(_cfg(3, "NONE", "cuda")).graphs is None
    assert execution(_cfg(3, "PIECEWISE", "cpu")).graphs is None  # the CPU platform replays no graphs


def test_dual_batch_overlap_is_refused():
    for flag in ("enable_dbo", "use_ubatching"):
        with pytest.raises(CompatibilityError, match=f"dual-batch overlap.*{flag}"):
            execution(_cfg(0, parallel={flag: True}))
    assert execution(_cfg(0, parallel={"enable_dbo": False})).compiled is False


def test_the_sequence_parallelism_pass_is_refused_under_compile():
    """vLLM's SP pass (0.23's `enable_sp`, older `enable_sequence_parallelism`) shards the residual inside the
    compiled graph (VLLM_COMPILE only); eager runs never apply it, unresolved (None) or off is fine."""
    for name in ("enable_sp", "enable_sequence_parallelism"):
        with pytest.raises(CompatibilityError, match=f"sequence-parallelism pass.*{name}.*enforce_eager"):
            execution(_cfg(3, **{name: True}))
        with pytest.raises(CompatibilityError, match="sequence-parallelism pass.*compilation_config="):
            execution(_cfg(3, "FULL_AND_PIECEWISE", "cuda", **{name: True}))
        assert execution(_cfg(3, **{name: False})).compiled is True
        assert execution(_cfg(3, **{name: None})).compiled is True
        assert execution(_cfg(0, **{name: True})).compiled is False
        assert execution(_cfg(2, **{name: True})).compiled is True  # the CPU platform's trace-once mode runs no passes


def test_what_cuda_graphs_cannot_capture_is_refused_by_name():
    from hscapture.capture.wiring import DevicePath, check_graphs

    ex = execution(_cfg(3, "FULL_AND_PIECEWISE", "cuda"))
    order = SimpleNamespace(pre_forward=True, runner=object())
    vc = _cfg(3, "FULL_AND_PIECEWISE", "cuda")
    check_graphs(ex, DevicePath("device", True), 1, 1, order, vc)  # what works
    with pytest.raises(CompatibilityError, match="pipeline parallelism.*--enforce-eager"):
        check_graphs(ex, DevicePath("host"), 2, 1, order, vc)
    with pytest.raises(CompatibilityError, match="device path.*HSCAPTURE_DEVICE_PATH=off.*--enforce-eager"):
        check_graphs(ex, DevicePath("host"), 1, 1, order, vc)
    with pytest.raises(CompatibilityError, match="no step preparation"):
        check_graphs(ex, DevicePath("device"), 1, 1, SimpleNamespace(pre_forward=False, runner=object()), vc)
    sp = _cfg(3, "FULL_AND_PIECEWISE", "cuda", parallel={"use_sequence_parallel_moe": True})
    with pytest.raises(CompatibilityError, match="sequence-parallel MoE"):
        check_graphs(ex, DevicePath("device"), 1, 2, order, sp)
    check_graphs(ex, DevicePath("device"), 1, 1, order, sp)  # one rank: nothing is sharded
