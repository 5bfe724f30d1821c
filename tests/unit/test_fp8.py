"""The fp8 format against speculators' own quantization (hs_connectors 0.9.0's ``fp8_utils``), bit for bit, and
its files against speculators' reader (``FP8Transfer``'s dequantization)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from hscapture import _native


def _fp8_utils():
    from support import speculators_path

    path = speculators_path("0.9.0")
    f = path / "hs_connectors" / "fp8_utils.py" if path else None
    if f is None or not f.exists():
        pytest.skip("hs-connectors 0.9.0 is not installed in <venv>/speculators-0.9.0 (scripts/setup.sh)")
    spec = importlib.util.spec_from_file_location("hs_fp8_utils", f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tensors():
    g = torch.Generator().manual_seed(7)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for T, n, H in ((1, 1, 1), (5, 3, 64), (33, 4, 40)):
            x = torch.randn(T, n, H, generator=g)
            # Per-token magnitudes from 1e-8 to 1e4, a token of zeros, single outliers.
            x = x * torch.logspace(-8, 4, T).view(T, 1, 1)
            x[T // 2] = 0
            if T > 2:
                x[1, 0, 0] = 3e4 if dtype != torch.float16 else 6e4
            yield x.to(dtype)


def test_codes_and_scales_are_speculators_bit_for_bit():
    fp8 = _fp8_utils()
    for x in _tensors():
        T, n, H = x.shape
        ref_codes, ref_scales = fp8.quantize_tensor_to_fp8(x)
        codes, scales = _native.fp8_quantize(x.contiguous().view(torch.uint8).numpy().tobytes(), str(x.dtype), T, n * H)
        got = torch.frombuffer(bytearray(codes), dtype=torch.uint8).view(T, n, H)
        assert torch.equal(got, ref_codes.view(torch.uint8)), f"{x.dtype} {list(x.shape)}: codes differ"
        assert torch.equal(torch.tensor(scales).view(T, 1, 1), ref_scales), f"{x.dtype} {list(x.shape)}: scales differ"


def test_every_bf16_value_is_cast_as_torch_casts_it():
    # One token holding every finite bf16 pattern at scale 1 (amax forced to 448 so the scale is 1.0).
    allbits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    v = allbits[torch.isfinite(allbits)].float().clamp(-448, 448)
    v = torch.cat([v, torch.tensor([448.0])]).to(torch.bfloat16).view(1, 1, -1)
    codes, scales = _native.fp8_quantize(v.view(torch.uint8).numpy().tobytes(), "bfloat16", 1, v.shape[-1])
    assert scales == [1.0]
    ref = v.float().to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(torch.frombuffer(bytearray(codes), dtype=torch.uint8).view(ref.shape), ref)


def test_a_file_reads_back_as_speculators_dequantizes_it(tmp_path):
    fp8 = _fp8_utils()
    from safetensors.torch import load_file

    x = next(t for t in _tensors() if t.dtype == torch.bfloat16 and t.shape[0] == 33)
    codes, scales = fp8.quantize_tensor_to_fp8(x)
    # hscapture writes the file; speculators' dequantization of what torch reads from it is what read_sample returns.
    ident = {"format": "fp8", "model": "m", "layer_ids": [1, 2, 3, 4], "convention": "after"}
    ident |= {"dtype": "float8_e4m3fn", "hidden_size": 40, "num_hidden_layers": 4}
    data = x.view(torch.uint8).numpy().tobytes()
    path = tmp_path / "hs_0.safetensors"
    path.write_bytes(_native.encode_sample("fp8", json.dumps(ident), list(range(33)), data, [33, 4, 40], "bfloat16"))
    st = load_file(str(path))
    assert torch.equal(st["hidden_states"].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(st["hidden_states_scales"], scales)
    ref = fp8.dequantize_fp8_tensor(st["hidden_states"], st["hidden_states_scales"], dtype=torch.bfloat16)
    s = _native.read_sample(str(path))
    assert (s["dtype"], s["stored"], s["shape"]) == ("bfloat16", "float8_e4m3fn", [33, 4, 40])
    got = torch.frombuffer(bytearray(s["data"]), dtype=torch.bfloat16).view(33, 4, 40)
    assert torch.equal(got, ref)
