"""wiring.enable_device on a (simulated) CUDA worker: the device path is asked for, with fp8 quantization exactly
when this rank writes fp8 files (the branch CPU runs never reach)."""

from types import SimpleNamespace as NS

import pytest
import torch

from hscapture.capture import cuda_libs, wiring
from hscapture.config import CaptureConfig


class Session:
    background = False
    device_bytes = 0

    def __init__(self):
        self.calls = []

    def enable_device(self, ordinal, rows, ring, overlap, fp8):
        self.calls.append((ordinal, rows, ring, overlap, fp8))
        return "compute_90"


@pytest.mark.parametrize(
    "fmt,writer,out,fp8",
    [
        ("fp8", True, "/o", True),
        ("hscapture", True, "/o", False),
        ("fp8", False, "/o", False),
        ("fp8", True, None, False),
    ],
)
def test_fp8_is_quantized_on_the_device_only_by_the_rank_writing_fp8_files(monkeypatch, fmt, writer, out, fp8):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda_libs, "preload_nvrtc", lambda: None)
    cfg = CaptureConfig(layers=(1, 2), convention="after", out=out, format=fmt)
    session = Session()
    vc = NS(device_config=NS(device_type="cuda"), scheduler_config=NS(max_num_batched_tokens=64))
    path = wiring.enable_device(session, cfg, writer, vc)
    assert (path.kind, path.fp8) == ("device", fp8)
    assert session.calls[0][1] == 64 and session.calls[0][4] is fp8
