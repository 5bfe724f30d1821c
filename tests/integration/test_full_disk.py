"""A full disk under a public server: the staging directory on a small tmpfs (mounted here; the test needs root), so
that a long prompt's file does not fit and a short one's does. The request whose file does not fit fails alone:
speculators' own client finds no file (no wait past its lock), nothing partial is left taking the space, and the
server serves the next request, whose file equals the offline capture. Before, the first failed write stopped the
capture and vLLM's engine with it, failing every request in flight."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from connector_support import SEQUENTIAL, load, serve, speculators

pytestmark = pytest.mark.integration

DISK = 64 << 10  # bytes: a few short prompts' files (1.5 KB a token here), never a long one's
ROW_BYTES = 3 * 128 * 4  # 3 captured layers of 128 float32 values


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "small-disk"
    disk.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_file_the_disk_cannot_hold_fails_its_request_alone_and_the_server_serves_on(prepared, small_disk):
    model, root, data, ids, offline = prepared
    short = min(range(len(ids)), key=lambda i: len(ids[i]))
    long = max(range(len(ids)), key=lambda i: len(ids[i]))
    assert len(ids[short]) * ROW_BYTES < DISK // 2 < DISK < len(ids[long]) * ROW_BYTES, "the dataset's lengths"
    sys.path.insert(0, str(speculators()))
    try:
        from hs_connectors.transfer import _load_hs_file  # speculators' own client: waits on the lock, then reads
    finally:
        sys.path.remove(str(speculators()))

    server, stage = serve(root, model, "file", extra=SEQUENTIAL, stage=small_disk / "stage")
    with server:
        failed = Path(server.complete(ids[long])["kv_transfer_params"]["hidden_states_path"])
        assert _load_hs_file(failed) is None, "the client finds no file once the lock goes, and never waits past it"
        left = [p.name for p in stage.iterdir() if not p.name.startswith(".hscapture")]
        assert left == [], f"nothing is left taking the space: {left}"
        for i in (short, short):  # the server serves on; twice: the disk has room again after each client's move
            path = Path(server.complete(ids[i])["kv_transfer_params"]["hidden_states_path"])
            got = _load_hs_file(path)
            assert got is not None, f"the next request's file is missing:\n{server.log()}"
            ref = load(offline / "hidden_states" / f"hs_{i}.safetensors")
            assert got["token_ids"].tolist() == ids[i] and torch.equal(got["hidden_states"], ref["hidden_states"])
            path.unlink()
    log = server.log_path.read_text(errors="replace")
    assert "could not be stored" in log and "No space left on device" in log, (
        "the operator is told why:\n" + log[-3000:]
    )
    assert "fails alone" in log and "EngineDeadError" not in log, log[-3000:]
