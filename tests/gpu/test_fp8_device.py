"""fp8 quantized on the device (`fp8.cu`, after each step's last layer) against its CPU twin (the writer's
quantization of the host path) and speculators' own `quantize_tensor_to_fp8`, bit for bit, through whole sessions
that write files: random chunked plans, padded rows, every output dtype."""

from __future__ import annotations

import importlib.util
import zlib
from pathlib import Path

import pytest
import torch
from test_device_path import H, make_steps, run

from hscapture import _native
from hscapture.capture.cuda_libs import preload_nvrtc

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def nvrtc():
    preload_nvrtc()


def _fp8_utils():
    from support import speculators_path

    path = speculators_path("0.9.0")
    f = path / "hs_connectors" / "fp8_utils.py" if path else None
    if f is None or not f.exists():
        pytest.skip(
            "hs-connectors 0.9.0's fp8_utils.py is not installed (scripts/setup.sh; on the GPU machine, staged)"
        )
    spec = importlib.util.spec_from_file_location("hs_fp8_utils", f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _capture(out: Path, steps, tensors, *, fmt: str, dtype: str, device: bool, ring: int, overlap: bool) -> dict:
    s = _native.CaptureSession(
        [1, 4, 7],
        "after",
        8,
        H,
        dtype,
        dtype,
        assemble=True,
        output=_native.Output({"kind": "directory", "root": str(out), "format": fmt, "durable": False}, model="t"),
    )
    if device:
        # fp8 asks for early copies on every step: the device must still copy at the end (the scales span every slot).
        early = 1 if fmt == "fp8" else None
        s.enable_device(
            torch.cuda.current_device(), 128, max(ring, 1) + int(overlap), overlap, fmt == "fp8", early_copy_bytes=early
        )
    if ring:
        s.set_background(ring)
    run(s, steps, tensors, device=device)
    s.finish()
    return {p.name: p.read_bytes() for p in sorted((out / "hidden_states").iterdir())}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("ring,overlap", [(0, False), (2, True)], ids=["inline", "ring2-overlap"])
def test_device_fp8_equals_the_twin_and_speculators(tmp_path, dtype, ring, overlap):
    from safetensors.torch import load

    fp8 = _fp8_utils()
    steps = make_steps(seed=zlib.crc32(dtype.encode()) % 1000)
    gen = torch.Generator().manual_seed(1)
    seq: list = []

    def fresh(rows, slot):
        # Per-token magnitudes over 1e-6..1e3 (denormal codes, large scales); padded rows the plan must skip.
        mag = torch.logspace(-6, 3, rows + 3)[torch.randperm(rows + 3, generator=gen)].unsqueeze(1)
        t = ((torch.randn(rows + 3, H, generator=gen) * mag).to(getattr(torch, dtype))[:rows], None)
        seq.append(t)
        return t

    host = _capture(tmp_path / "host", steps, fresh, fmt="fp8", dtype=dtype, device=False, ring=ring, overlap=overlap)
    it = iter(list(seq))
    dev = _capture(
        tmp_path / "dev", steps, lambda r, s: next(it), fmt="fp8", dtype=dtype, device=True, ring=ring, overlap=overlap
    )
    it = iter(list(seq))
    plain = _capture(
        tmp_path / "plain",
        steps,
        lambda r, s: next(it),
        fmt="hscapture",
        dtype=dtype,
        device=True,
        ring=0,
        overlap=False,
    )
    assert sorted(dev) == sorted(host) == sorted(plain) and dev
    for name, data in dev.items():
        assert data == host[name], f"{name}: the device's fp8 file differs from the CPU twin's"
        got, states = load(data), load(plain[name])["hidden_states"]
        codes, scales = fp8.quantize_tensor_to_fp8(states)
        assert torch.equal(got["hidden_states"].view(torch.uint8), codes.view(torch.uint8)), f"{name}: codes"
        assert torch.equal(got["hidden_states_scales"], scales), f"{name}: scales"
