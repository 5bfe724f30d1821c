"""The device path inside CUDA graphs, without vLLM: a graph records each slot's capture launch once (outside any
step, where the launch writes nothing), and every replay stores the step armed before it, bit for bit what the CPU
twin stores from the same tensors. A replay between steps writes nothing; a graph that lacks a slot's launch fails the
step naming the slot; a graph that outlives its session replays harmlessly."""

from __future__ import annotations

import pytest
import torch
from test_device_path import H, make_steps, run

from hscapture import CompatibilityError, _native
from hscapture.adapters.vllm_compat import step_of
from hscapture.capture.cuda_libs import preload_nvrtc

pytestmark = pytest.mark.gpu
PAD = 96  # the graph's static batch: every step's tokens, padded (as vLLM pads to a capture size)


@pytest.fixture(scope="module", autouse=True)
def nvrtc():
    preload_nvrtc()


def _session(overlap: bool) -> _native.CaptureSession:
    s = _native.CaptureSession([1, 4, 7], "after", 8, H, "bfloat16", "bfloat16", assemble=True)
    s.enable_device(torch.cuda.current_device(), 128, 2 + int(overlap), overlap)
    return s


def _graph(s, static_h, static_r, slots) -> torch.cuda.CUDAGraph:
    """Records the slots' launches into a graph, as vLLM's capture records the hooks' (outside any step)."""
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch asks
        for slot in slots:
            s.capture(slot, static_h, static_r, torch.cuda.current_stream().cuda_stream)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        for slot in slots:
            s.capture(slot, static_h, static_r, torch.cuda.current_stream().cuda_stream)
    return g


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_every_replay_stores_the_step_armed_before_it(overlap):
    steps = make_steps(seed=7, budget=PAD)
    gen = torch.Generator().manual_seed(2)
    data = []
    for so, _ in steps:
        n = so.total_num_scheduled_tokens
        data.append([(torch.randn(n, H, generator=gen) * 30).to(torch.bfloat16) for _ in range(3)])

    cpu = _native.CaptureSession([1, 4, 7], "after", 8, H, "bfloat16", "bfloat16", assemble=True)
    it = iter([(d, None) for step in data for d in step])
    want_out, want = run(cpu, steps, lambda rows, slot: next(it), device=False)

    s = _session(overlap)
    static = [torch.zeros(PAD, H, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    graphs = [_graph(s, static[slot], None, [slot]) for slot in range(3)]
    stream = torch.cuda.current_stream().cuda_stream
    got_out = []
    for k, (so, order) in enumerate(steps):
        n = so.total_num_scheduled_tokens
        got_out += s.begin_step(step_of(so))
        s.plan(order, stream)  # armed before the forward, as hscapture's wrapper of the runner's step preparation does
        for slot in range(3):
            static[slot].normal_()  # padding rows hold garbage, as a padded batch does
            static[slot][:n].copy_(data[k][slot].cuda())
            graphs[slot].replay()
        got_out += s.end_step()
        for slot in range(3):  # a forward between steps (a dummy batch, a warm-up): disarmed, it writes nothing
            static[slot].fill_(float("nan"))
            graphs[slot].replay()
    got_out += s.flush()
    s.release()
    got = {d["sample"]: d for d in s.take_samples()}
    assert [o[:3] for o in got_out] == [o[:3] for o in want_out], "step checksums (or rows) differ from the CPU twin's"
    assert sorted(got) == sorted(want) and got
    for key in want:
        assert got[key]["data"] == want[key]["data"], f"sample {key} differs from the CPU twin's"


def test_a_graph_without_a_slots_launch_fails_the_step_naming_it():
    s = _session(True)
    h = torch.randn(PAD, H, device="cuda").to(torch.bfloat16)
    g = _graph(s, h, None, [0, 2])  # slot 1 (layer id 4) was never recorded
    stream = torch.cuda.current_stream().cuda_stream
    from test_device_path import new_req, sched

    s.begin_step(step_of(sched(new=[new_req("a", 10, 0)], n={"a": 10})))
    s.plan(["a"], stream)
    g.replay()
    s.end_step()
    with pytest.raises(CompatibilityError, match=r"layer id 4 .*was not captured by the step's forward .*never ran"):
        s.flush()


def test_a_graph_that_outlives_its_session_replays_harmlessly():
    """The arena goes with the session; the control block the graph reads stays, disarmed, and so does the kernel's
    module. The replays run under the profiler (CUPTI resolves each replayed kernel): a graph node of an unloaded
    module crashed the process there (H200, 2026-12-03), where without CUPTI it happened to run."""
    from torch.profiler import ProfilerActivity, profile

    s = _session(True)
    h = torch.randn(PAD, H, device="cuda").to(torch.bfloat16)
    g = _graph(s, h, None, [0, 1, 2])
    del s
    with profile(activities=[ProfilerActivity.CUDA]):
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
