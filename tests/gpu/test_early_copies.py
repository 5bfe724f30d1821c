"""Early copies: in a large step each layer's rows leave for the host as soon as its capture kernel ran, while the
forward goes on; the samples stay the CPU twin's, bit for bit, a layer captured twice in a step keeps its last rows,
and a launch recorded into a CUDA graph mid-step leaves the copies to the step's end."""

from __future__ import annotations

import json

import pytest
import torch
from test_device_path import equal_to_the_cpu_twin, new_req, sched

from hscapture import _native
from hscapture.adapters.vllm_compat import step_of
from hscapture.capture.cuda_libs import preload_nvrtc

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def nvrtc():
    preload_nvrtc()


@pytest.mark.parametrize(
    "ring,overlap,small", [(0, 0, 0), (2, 1, 0), (2, 2, 24)], ids=["inline", "ring2-overlap", "overlap2-small"]
)
def test_early_copies_equal_the_cpu_twin(ring, overlap, small):
    """Every step copies early (`early_copy_bytes=1`): random chunked schedules, residuals, the assembler thread
    reading while later steps copy, small buffers for small steps."""
    equal_to_the_cpu_twin("bfloat16", "bfloat16", True, ring, overlap, small, early=1)


def _session(layers, width, rows, early=1, overlap=1):
    s = _native.CaptureSession(layers, "after", 8, width, "bfloat16", "bfloat16", assemble=True)
    s.enable_device(torch.cuda.current_device(), rows, 2 + overlap, overlap, early_copy_bytes=early)
    return s


def _samples(s):
    s.flush()
    s.release()
    return {d["sample"]: d for d in s.take_samples()}


def test_a_layer_captured_twice_keeps_its_last_rows():
    """A slot launched twice in a step is copied again after its second launch: the sample holds the last launch's
    rows, as the host path's and the step's end copies would. (The second launch also waits for the first early
    copy, so that no copy reads rows being overwritten; a torn first copy would be overwritten by the second on the
    same stream, so this test cannot see that wait.)"""
    rows, width = 16384, 4096
    first, last, other = (torch.randn(rows, width, device="cuda").to(torch.bfloat16) + k for k in range(3))
    s = _session([1, 2], width, rows)
    stream = torch.cuda.current_stream().cuda_stream
    torch.cuda.synchronize()
    s.begin_step(step_of(sched(new=[new_req("a", rows, 0)], n={"a": rows})))
    s.plan(["a"], stream)
    s.capture(0, first, None, stream)
    s.capture(0, last, None, stream)
    s.capture(1, other, None, stream)
    s.end_step()
    got = _samples(s)[0]["data"]
    per_layer = [t.cpu().view(torch.int16).numpy().tobytes() for t in (last, other)]
    # A sample's rows are token-major: each token's layers side by side.
    want = b"".join(per_layer[k][i * width * 2 : (i + 1) * width * 2] for i in range(rows) for k in range(2))
    assert got == want, "the sample does not hold the last launch's rows of layer 1"


def test_a_layers_rows_leave_while_the_forward_goes_on(tmp_path):
    """Layer 1's rows are captured, then the forward computes (matmuls, several ms), then layer 2's: layer 1's copy
    to the host starts before layer 2's capture kernel. With early copies off (the default, `early_copy_bytes=None`)
    every copy starts after it."""
    from torch.profiler import ProfilerActivity, profile

    rows, width = 8192, 4096
    a = torch.randn(rows, width, device="cuda").to(torch.bfloat16)
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.current_stream().cuda_stream

    def step(s, k):
        s.begin_step(step_of(sched(new=[new_req(f"r{k}", rows, k)], n={f"r{k}": rows})))
        s.plan([f"r{k}"], stream)
        s.capture(0, a, None, stream)
        x = m
        for _ in range(20):
            x = (x @ m).clamp_(-1, 1)
        s.capture(1, a, None, stream)
        s.end_step()

    def first_copy_vs_last_capture(early):
        s = _session([1, 2], width, rows, early=early)
        step(s, 0)  # warm-up
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(s, 1)
            torch.cuda.synchronize()
        _samples(s)
        path = tmp_path / f"trace-{early}.json"
        prof.export_chrome_trace(str(path))
        ev = json.loads(path.read_text())["traceEvents"]
        # The rows' copies: a layer's rows each (early), or neighbouring layers' rows in one strided copy (the end).
        slot_bytes = rows * width * 2
        dtoh = [e for e in ev if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")]
        copies = [e for e in dtoh if int(e.get("args", {}).get("bytes", 0)) % slot_bytes == 0]
        copied = sum(int(e["args"]["bytes"]) for e in copies)
        seen = [(e.get("name"), e.get("args", {}).get("bytes")) for e in ev if e.get("cat") == "gpu_memcpy"]
        # Layer 2's capture kernel, the last of the forward (the matmuls' kernel names vary with cuBLAS).
        taps = sorted(
            (e for e in ev if e.get("cat") == "kernel" and "hscapture_capture" in e.get("name", "")),
            key=lambda e: e["ts"],
        )
        assert copied == 2 * slot_bytes and len(taps) == 2, (
            f"the trace shows {copied} bytes of rows copied (want {2 * slot_bytes}) and {len(taps)} captures; "
            f"its copies: {seen}"
        )
        if early:
            assert len(copies) == 2, f"early: each layer's rows in a copy of their own; the trace's copies: {seen}"
        return min(c["ts"] for c in copies), taps[1]["ts"]

    start, last_capture = first_copy_vs_last_capture(1)
    assert start < last_capture, f"early: layer 1's copy started {start - last_capture:.0f} µs after layer 2's capture"
    start, last_capture = first_copy_vs_last_capture(None)
    assert start > last_capture, f"end copies: a copy started {last_capture - start:.0f} µs before layer 2's capture"


def test_a_launch_recorded_into_a_graph_copies_at_the_end():
    """A step armed on the forward's stream, layer 1 captured eagerly (copied early), layer 2's launch recorded into
    a CUDA graph and replayed: the copy stream never joins the capture (it would leave it unjoined, an error), and
    the step's end copies both layers."""
    rows, width = 4096, 1024
    h = [torch.randn(rows, width, device="cuda").to(torch.bfloat16) + k for k in range(2)]
    s = _session([1, 2], width, rows)
    stream = torch.cuda.current_stream().cuda_stream
    torch.cuda.synchronize()
    s.begin_step(step_of(sched(new=[new_req("a", rows, 0)], n={"a": rows})))
    s.plan(["a"], stream)
    s.capture(0, h[0], None, stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        s.capture(1, h[1], None, torch.cuda.current_stream().cuda_stream)
    g.replay()
    s.end_step()
    got = _samples(s)[0]["data"]
    per_layer = [t.cpu().view(torch.int16).numpy().tobytes() for t in h]
    want = b"".join(per_layer[k][i * width * 2 : (i + 1) * width * 2] for i in range(rows) for k in range(2))
    assert got == want
