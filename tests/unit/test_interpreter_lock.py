"""The step protocol's calls keep the interpreter's lock and let go of it only around the core's waits
(`crates/worker/src/blocking.rs`): a wait must never stall the process's other Python threads, and a call that does
not wait must not hand the lock to them (winning it back costs up to their switch interval)."""

from __future__ import annotations

import threading
import time

import torch

from hscapture import _native
from hscapture.adapters.vllm_compat import step_of
from support import new_req, sched


def test_a_wait_for_the_disk_lets_other_python_threads_run(tmp_path):
    """Per-request files with no backlog on a disk held by a file: the release after the step that completes a
    sample waits until its file is written. Only a Python thread can remove the hold file, so the wait ends at once
    only if the lock is let go of while it waits (held, the release would stall until the backlog's deadline)."""
    hold = tmp_path / "hold"
    hold.write_text("")
    out = {"kind": "staging", "root": str(tmp_path / "stage"), "format": "file", "durable": False, "backlog_mib": 0}
    output = _native.Output(out).on_slow_disk(0, str(hold))
    s = _native.CaptureSession([1], "after", 3, 8, "float32", "float32", assemble=True, output=output)
    s.begin_step(step_of(sched(new=[new_req("r", [5, 6, 7], None)], n={"r": 3})))
    s.plan(["r"])
    h = torch.arange(24, dtype=torch.float32).reshape(3, 8) + 1
    s.capture(0, h, None)
    s.end_step()
    ran = []

    def unhold():
        time.sleep(0.3)
        ran.append(time.monotonic())
        hold.unlink()

    t = threading.Thread(target=unhold)
    t.start()
    start = time.monotonic()
    s.release()  # waits for room: the file must be written first
    waited = time.monotonic() - start
    t.join()
    assert ran and ran[0] < start + waited, "the other thread ran while the release waited"
    assert not [n for n in s.take_notes() if "stalled" in n.lower()], "the wait ended by the file, not the deadline"
    assert (tmp_path / "stage" / f"{_native.staged_file_name('r')}").exists()
    s.finish()
