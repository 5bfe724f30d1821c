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

    def enable_device(self, ordinal, rows, ring, overlap, fp8, small_rows=0, early_copy_bytes=None):
        self.calls.append((ordinal, rows, ring, overlap, fp8, small_rows, early_copy_bytes))
        return "compute_90"


@pytest.fixture
def vc(monkeypatch):
    """A CUDA worker's vLLM configuration, with CUDA and NVRTC simulated."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda_libs, "preload_nvrtc", lambda: None)
    return NS(device_config=NS(device_type="cuda"), scheduler_config=NS(max_num_batched_tokens=64))


@pytest.mark.parametrize(
    "fmt,writer,out,fp8",
    [
        ("fp8", True, "/o", True),
        ("hscapture", True, "/o", False),
        ("fp8", False, "/o", False),
        ("fp8", True, None, False),
    ],
)
def test_fp8_is_quantized_on_the_device_only_by_the_rank_writing_fp8_files(vc, fmt, writer, out, fp8):
    cfg = CaptureConfig(layers=(1, 2), convention="after", out=out, format=fmt)
    session = Session()
    path = wiring.enable_device(session, cfg, writer, vc)
    assert (path.kind, path.fp8) == ("device", fp8)
    assert session.calls[0][1] == 64 and session.calls[0][4] is fp8


@pytest.mark.parametrize("overlap,ring", [("0", 1), ("1", 2), ("2", 3)])
def test_steps_kept_in_flight_size_the_ring(monkeypatch, vc, overlap, ring):
    """Each step kept in flight holds a pinned buffer of its own (a verifying rank: no assembler ring)."""
    monkeypatch.setenv("HSCAPTURE_DEVICE_OVERLAP", overlap)
    session = Session()
    path = wiring.enable_device(session, CaptureConfig(layers=(1,), convention="after"), False, vc)
    assert (path.overlap, session.calls[0][2], session.calls[0][3]) == (int(overlap), ring, int(overlap))


@pytest.mark.parametrize("mib,early", [(None, None), ("-1", None), ("0", 1), ("4", 4 << 20), (str(2**60), 2**60)])
def test_early_copies_are_asked_for_by_size(monkeypatch, vc, mib, early):
    """HSCAPTURE_EARLY_COPY_MIB reaches the device as bytes of rows per layer: unset or negative never, 0 every step,
    a huge value capped (the core's threshold is a usize)."""
    if mib is None:
        monkeypatch.delenv("HSCAPTURE_EARLY_COPY_MIB", raising=False)
    else:
        monkeypatch.setenv("HSCAPTURE_EARLY_COPY_MIB", mib)
    session = Session()
    wiring.enable_device(session, CaptureConfig(layers=(1,), convention="after"), True, vc)
    assert session.calls[0][6] == early


@pytest.mark.parametrize(
    "var,value,message",
    [
        ("HSCAPTURE_DEVICE_OVERLAP", "3", "HSCAPTURE_DEVICE_OVERLAP=3 is not valid"),
        ("HSCAPTURE_EARLY_COPY_MIB", "4MiB", "HSCAPTURE_EARLY_COPY_MIB"),  # refused, not a fallback to host copies
    ],
)
def test_a_bad_device_setting_is_refused(monkeypatch, vc, var, value, message):
    from hscapture import ConfigError

    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=message):
        wiring.enable_device(Session(), CaptureConfig(layers=(1,), convention="after"), False, vc)


@pytest.mark.parametrize(
    "writer,out,store,warned",
    [(True, None, None, True), (True, "/x", None, False), (True, None, object(), False), (False, None, None, False)],
)
def test_a_writer_without_out_or_store_says_nothing_is_written(caplog, writer, out, store, warned):
    """Reliability row 64: samples kept in memory for the RPC surface are announced once, at start-up."""
    from hscapture.capture.wiring import warn_if_nothing_is_written

    caplog.set_level("WARNING", logger="hscapture")
    warn_if_nothing_is_written(writer, CaptureConfig(layers=(1,), convention="after", out=out), store)
    assert ("nothing is written to disk" in caplog.text) is warned


@pytest.mark.parametrize(
    "seqs,spec,small",
    [
        (256, None, 256),
        (1024, NS(num_speculative_tokens=3), 4096),
        (8, NS(num_speculative_tokens=None), 8),
        (None, None, 0),
    ],
)
def test_decode_steps_get_pinned_buffers_of_their_own_size(monkeypatch, seqs, spec, small):
    """A decode step's rows (max_num_seqs × (1 + speculative tokens)) size the small pinned buffers, so that decode
    steps do not wait for the full ones the assembler still reads after a prompt step."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda_libs, "preload_nvrtc", lambda: None)
    session = Session()
    sched = NS(max_num_batched_tokens=8192, max_num_seqs=seqs)
    vc = NS(device_config=NS(device_type="cuda"), scheduler_config=sched, speculative_config=spec)
    wiring.enable_device(session, CaptureConfig(layers=(1,), convention="after"), False, vc)
    assert session.calls[0][1] == 8192 and session.calls[0][5] == small
