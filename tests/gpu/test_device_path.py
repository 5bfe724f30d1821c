"""The CUDA capture path against its CPU twin, bit for bit, through the whole session: random plans,
chunking, residuals, all dtype pairs, NaN/Inf, checksums; plus a leak check."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

import support
from hscapture import NonFiniteError, _native
from hscapture.adapters.vllm_compat import step_of
from hscapture.capture.cuda_libs import preload_nvrtc
from support import sched

pytestmark = pytest.mark.gpu
H = 1000  # not a multiple of the block size: exercises the strided tail


def new_req(rid, length, sample):
    return support.new_req(rid, list(range(length)), sample)


def make_steps(seed: int, n_req: int = 12, budget: int = 96):
    """A random schedule: requests of random lengths, chunked prefill under a token budget, random
    runner order, decode tokens of finished prompts mixed in."""
    rng = random.Random(seed)
    lengths = {f"r{i}": rng.randint(1, 150) for i in range(n_req)}
    done = {r: 0 for r in lengths}
    announced: set[str] = set()
    steps = []
    while any(done[r] < lengths[r] for r in lengths):
        n, new, cached, left = {}, [], [], budget
        for r in lengths:
            if left == 0:
                break
            if done[r] >= lengths[r]:
                if r in announced and rng.random() < 0.3:
                    n[r], left = 1, left - 1  # a decode token
                    cached.append((r, done[r]))
                continue
            k = min(left, lengths[r] - done[r], rng.randint(1, 64))
            n[r], left = k, left - k
            (cached.append((r, done[r])) if r in announced else new.append(new_req(r, lengths[r], int(r[1:]))))
            announced.add(r)
        for r, k in n.items():
            done[r] = min(lengths[r], done[r] + k) if done[r] < lengths[r] else done[r]
        order = list(n)
        rng.shuffle(order)
        steps.append((sched(new=new, cached=cached, n=n), order))
    return steps


def run(session, steps, tensors, device: bool):
    outcomes = []
    for so, order in steps:
        outcomes += session.begin_step(step_of(so))
        session.plan(order)
        for slot in range(len(session.layer_ids)):
            h, r = tensors(so.total_num_scheduled_tokens, slot)
            if device:
                h, r = h.cuda(), (r.cuda() if r is not None else None)
                session.capture(slot, h, r, torch.cuda.current_stream().cuda_stream)
            else:
                session.capture(slot, h, r)
        outcomes += session.end_step()
    outcomes += session.flush()
    session.release()  # no other rank to agree with: every accounted step's samples may be stored
    return outcomes, {d["sample"]: d for d in session.take_samples()}


@pytest.fixture(scope="module", autouse=True)
def nvrtc():
    preload_nvrtc()


@pytest.mark.parametrize(
    "in_dtype,out_dtype",
    [(a, b) for a in ("float32", "bfloat16", "float16") for b in ("float32", "bfloat16", "float16")],
)
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize(
    "ring,overlap",
    [(0, False), (0, True), (2, True), (3, False)],
    ids=["inline", "inline-overlap", "ring2-overlap", "ring3"],
)
def test_device_equals_cpu_twin_bit_for_bit(in_dtype, out_dtype, residual, ring, overlap):
    """The kernel equals its CPU twin through whole sessions; with a ring, the pinned buffers are read on the
    assembler thread while later steps copy into the others; with overlap, a step begins and is launched
    while the previous one's copies are in flight."""
    equal_to_the_cpu_twin(in_dtype, out_dtype, residual, ring, overlap)


@pytest.mark.parametrize("overlap", [1, 2])
@pytest.mark.parametrize("small", [1, 24])
def test_small_pinned_buffers_serve_the_steps_they_hold(overlap, small):
    """With pinned buffers of `small` rows besides the full ones (the decode steps' size), steps of up to `small`
    rows take those and larger ones the full ones, buffers of both sizes in flight and with the assembler at once:
    the samples stay the CPU twin's, bit for bit."""
    equal_to_the_cpu_twin("bfloat16", "bfloat16", True, 2, overlap, small)


def equal_to_the_cpu_twin(in_dtype, out_dtype, residual, ring, overlap, small=0, early=None):
    """`early`: the device's `early_copy_bytes` (1: every step's rows leave slot by slot during the forward)."""
    steps = make_steps(seed=zlib.crc32(f"{in_dtype}{out_dtype}{residual}".encode()) % 1000)
    gen = torch.Generator().manual_seed(0)
    cache: dict = {}

    def tensors(rows, slot):
        key = (len(cache), rows, slot)
        if key not in cache:
            h = (torch.randn(rows + 3, H, generator=gen) * 30).to(getattr(torch, in_dtype))[:rows]  # padded rows
            r = (torch.randn(rows + 3, H, generator=gen) * 30).to(getattr(torch, in_dtype))[:rows] if residual else None
            cache[key] = (h, r)
        return cache[key]

    def session():
        return _native.CaptureSession([1, 4, 7], "after", 8, H, in_dtype, out_dtype, assemble=True)

    cpu = session()
    seq = []
    orig = tensors

    def record(rows, slot):
        t = orig(rows, slot)
        seq.append(t)
        return t

    cpu_out, cpu_samples = run(cpu, steps, record, device=False)
    it = iter(seq)
    dev = session()
    more = {} if early is None else {"early_copy_bytes": early}
    dev.enable_device(torch.cuda.current_device(), 128, max(ring, 1) + int(overlap), overlap, small_rows=small, **more)
    if ring:
        dev.set_background(ring)
    dev_out, dev_samples = run(dev, steps, lambda rows, slot: next(it), device=True)
    assert [o[:3] for o in cpu_out] == [o[:3] for o in dev_out], (
        "step checksums (or rows) differ between the kernel and its CPU twin"
    )
    assert sorted(cpu_samples) == sorted(dev_samples)
    for k in cpu_samples:
        assert cpu_samples[k]["data"] == dev_samples[k]["data"], f"sample {k} differs"


@pytest.mark.parametrize("assembly", ["inline", "background"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_a_step_in_flight_is_not_overwritten_by_the_next(overlap, assembly):
    """Step N+1's kernel is enqueued while step N's copy of a 128 MiB arena (a few ms) still runs: the
    capture stream waits for it on the device. Without that wait the copy would read step N+1's rows. With
    background assembly the assembler thread holds a step's pinned buffer (shared) while the next steps are
    copied: the ring must copy only into a buffer nobody reads."""
    rows, width, steps = 16384, 4096, 6
    s = _native.CaptureSession([1], "after", 8, width, "bfloat16", "bfloat16", assemble=True)
    ring = 2 + int(overlap)
    if assembly == "background":
        s.set_background(ring)
    s.enable_device(torch.cuda.current_device(), rows, ring, overlap)
    states = [torch.randn(rows, width, device="cuda").to(torch.bfloat16) + k for k in range(steps)]
    stream = torch.cuda.current_stream().cuda_stream
    torch.cuda.synchronize()
    for k in range(steps):
        s.begin_step(step_of(sched(new=[new_req(f"r{k}", rows, k)], n={f"r{k}": rows})))
        s.plan([f"r{k}"])
        s.capture(0, states[k], None, stream)
        s.end_step()
    s.flush()
    s.release()
    got = {d["sample"]: d for d in s.take_samples()}
    assert sorted(got) == list(range(steps))
    for k in range(steps):
        want = states[k].cpu().view(torch.int16).numpy().tobytes()
        assert got[k]["data"] == want, f"step {k}: the stored rows are not the step's own"


def test_non_finite_values_are_reported_from_the_device():
    s = _native.CaptureSession([2], "after", 4, H, "float16", "float16", assemble=True)
    s.enable_device(torch.cuda.current_device(), 64)
    s.begin_step(step_of(sched(new=[new_req("a", 4, 9)], n={"a": 4})))
    s.plan(["a"])
    h = torch.zeros(4, H, dtype=torch.float16, device="cuda")
    h[2, 5] = 60000.0
    s.capture(0, h, h.clone(), torch.cuda.current_stream().cuda_stream)  # 60000 + 60000 overflows float16
    s.end_step()
    with pytest.raises(NonFiniteError, match=r"sample 9 .*layer id 2.*1 NaN/Inf .*first at position 2"):
        s.flush()


def test_no_device_memory_leaks():
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    for _ in range(20):
        s = _native.CaptureSession([1, 2, 3, 4], "after", 8, 4096, "bfloat16", "bfloat16", assemble=True)
        s.enable_device(torch.cuda.current_device(), 8192)
        assert s.device_bytes >= 4 * 8192 * 4096 * 2
        del s
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    assert abs(free1 - free0) < 64 << 20, f"device memory changed by {(free0 - free1) / 2**20:.0f} MiB over 20 sessions"


def test_a_step_copies_only_its_rows_to_the_host(tmp_path):
    """A decode-sized step (4 rows) in an arena of 16,384 rows × 4,096: the copies to the pinned buffers move the
    step's rows, not the arena's capacity (cudarc's `memcpy_dtoh` copies its destination's whole length: 128 MiB a
    slot a step, which made decode under CUDA graphs 0.6× of plain). Measured from the CUDA trace's copy sizes."""
    import json

    from torch.profiler import ProfilerActivity, profile

    rows, width, layers = 16384, 4096, [1, 2]
    s = _native.CaptureSession(layers, "after", 8, width, "bfloat16", "bfloat16", assemble=True)
    s.enable_device(torch.cuda.current_device(), rows, 2, True)
    stream = torch.cuda.current_stream().cuda_stream
    states = torch.randn(4, width, device="cuda").to(torch.bfloat16)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for k in range(3):
            s.begin_step(step_of(sched(new=[new_req(f"r{k}", 4, k)], n={f"r{k}": 4})))
            s.plan([f"r{k}"])
            for slot in range(len(layers)):
                s.capture(slot, states, None, stream)
            s.end_step()
        s.flush()
        torch.cuda.synchronize()
    s.release()
    assert sorted(d["sample"] for d in s.take_samples()) == [0, 1, 2]
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")]
    assert copies, "the trace shows no device-to-host copy: the profiler saw nothing of the capture's copies"
    moved = sum(int(e.get("args", {}).get("bytes", 0)) for e in copies)
    step_rows = 3 * len(layers) * 4 * (width * 2 + 8 + 4)  # rows, checksums, non-finite counts
    assert moved <= step_rows + (1 << 16), f"{moved:,} bytes copied to the host for 3 steps of {step_rows // 3:,} bytes"
