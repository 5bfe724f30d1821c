"""Each step-protocol call into the core, timed alone, with and without a busy Python thread beside it (the engine's
other threads): a call that lets go of the interpreter's lock must win it back, which costs up to the other thread's
switch interval. A real core session, no engine: 64 requests prefilled in one step, then decode steps of one token
each (prompt only: the decode steps capture no rows, so what is timed is the calls themselves), 4 layers, inline.

    python bench/step_calls.py [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hscapture import _native  # noqa: E402
from hscapture.adapters.vllm_compat import step_of  # noqa: E402
from support import new_req, sched  # noqa: E402 - the suites' own vLLM-shaped fakes


def measure(steps: int, requests: int = 64, hidden: int = 64) -> dict[str, float]:
    s = _native.CaptureSession([1, 2, 3, 4], "after", 6, hidden, "bfloat16", "bfloat16", assemble=True)
    ids = [f"r{i}" for i in range(requests)]
    new = [new_req(r, list(range(4, 36)), i) for i, r in enumerate(ids)]
    s.begin_step(step_of(sched(new=new, n=dict.fromkeys(ids, 32))))
    s.plan(ids)
    h = torch.randn(requests * 32, hidden, dtype=torch.bfloat16)
    for slot in range(4):
        s.capture(slot, h, h, 0)
    s.end_step()
    t: dict[str, list[float]] = {"begin_step": [], "plan": [], "capture": [], "end_step": [], "release": []}

    def timed(name, call, *args):
        a = time.perf_counter()
        call(*args)
        t[name].append(time.perf_counter() - a)

    for d in range(steps):
        timed("begin_step", s.begin_step, step_of(sched(cached=[(r, 32 + d) for r in ids], n=dict.fromkeys(ids, 1))))
        timed("plan", s.plan, ids)
        for slot in range(4):
            timed("capture", s.capture, slot, h[:requests], h[:requests], 0)
        timed("end_step", s.end_step)
        timed("release", s.release)
    s.finish()
    return {k: statistics.mean(v) * 1e6 for k, v in t.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args()
    alone = measure(a.steps)
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    threading.Thread(target=spin, daemon=True).start()
    busy = measure(a.steps)
    stop.set()
    print("µs per call (mean) | alone | a busy Python thread beside | ratio")
    for k in alone:
        print(f"{k:18s} | {alone[k]:7.1f} | {busy[k]:9.1f} | {busy[k] / alone[k]:5.1f}×")


if __name__ == "__main__":
    main()
