"""What the engine's thread does besides computing, over a benchmark's timed rounds (bench/gpu_run.py, in the worker's
process through `collective_rpc`): Python's garbage collections (per generation: how many, and their seconds, on
any thread) and the engine thread's minor page faults and CPU time inside each step (`execute_model`, and
`sample_tokens` where the runner splits the step) and, with HSBENCH_WATCH=1 and hscapture, inside its `begin` and
`end` and each call into its core (`core.<method>`: the Rust side's own allocations show there).

Why: eager decode with capture has lost 2–40 % to plain from one pass to the next while hscapture's own timed work
stayed near 0.4 ms a step, and the passes that lost most had the engine's thread take ~17,400 minor page faults
against a few hundred in plain (docs/benchmarks.md). These counters say whether those faults, and collections, fall
in hscapture's parts, in vLLM's part of the step, or between steps (the thread's total, `thread_minflt`, minus the
steps'). Each wrapped call reads the thread's counters twice (~2 µs): the step's calls in every mode alike;
hscapture's parts and core calls (about ten a decode step) only with HSBENCH_WATCH=1, as they add to its side only."""

from __future__ import annotations

import gc
import os
import resource
import threading
import time

STEP_CALLS = ("execute_model", "sample_tokens")
CAPTURE_PARTS = ("begin", "end")


class Watch:
    def __init__(self) -> None:
        self.gc = {g: [0, 0] for g in range(3)}  # generation: [collections, ns]
        self.calls: dict[str, list[int]] = {}  # name: [calls, minor faults, thread CPU ns]
        self.walls: dict[str, list[tuple[int, int]]] = {n: [] for n in STEP_CALLS}  # (start, end) ns, to `take_round`
        self._started: dict[int, int] = {}

    def on_gc(self, phase: str, info: dict) -> None:
        tid = threading.get_ident()
        if phase == "start":
            self._started[tid] = time.perf_counter_ns()
            return
        t0 = self._started.pop(tid, None)
        g = self.gc.setdefault(int(info.get("generation", 0)), [0, 0])
        g[0] += 1
        if t0 is not None:
            g[1] += time.perf_counter_ns() - t0

    def wrap(self, name: str, fn):
        acc = self.calls.setdefault(name, [0, 0, 0])
        walls = self.walls.get(name)

        def call(*args, **kwargs):
            f0, c0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt, time.thread_time_ns()
            w0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                if walls is not None:
                    walls.append((w0, time.perf_counter_ns()))
                acc[0] += 1
                acc[1] += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0
                acc[2] += time.thread_time_ns() - c0

        return call

    def reset(self) -> None:
        for v in (*self.gc.values(), *self.calls.values()):
            v[:] = [0] * len(v)
        for w in self.walls.values():
            w.clear()

    def take_round(self) -> dict:
        """The step calls' wall times since the last take: per call name [calls, median ms, 90th percentile ms, sum s],
        and ``span_s`` from the first call's start to the last's end. A round's time splits into its steps' calls and
        the rest (``span_s`` minus the sums: vLLM's scheduler and output handling between them), and a median is
        not moved by a few stalls, where a round's total is."""
        out: dict = {}
        starts, ends = [], []
        for name, w in self.walls.items():
            if not w:
                continue
            d = sorted(b - a for a, b in w)
            out[name] = [len(d), round(d[len(d) // 2] / 1e6, 3), round(d[(len(d) * 9) // 10] / 1e6, 3), sum(d) / 1e9]
            starts.append(w[0][0])
            ends.append(w[-1][1])
            w.clear()
        if starts:
            out["span_s"] = (max(ends) - min(starts)) / 1e9
        return out

    def summary(self) -> dict:
        return {
            "gc": {f"gen{g}": [n, round(ns / 1e6, 1)] for g, (n, ns) in sorted(self.gc.items())},
            "calls": {k: [n, f, round(ns / 1e6, 1)] for k, (n, f, ns) in self.calls.items() if n},
        }


class _CoreCalls:
    """The capture's core session as hscapture's Python sees it, each method call counted (``core.<name>``);
    attributes that are not methods read through."""

    def __init__(self, watch: Watch, session) -> None:
        self._watch, self._session, self._wrapped = watch, session, {}

    def __getattr__(self, name: str):
        value = getattr(self._session, name)
        if not callable(value):
            return value
        fn = self._wrapped.get(name)
        if fn is None:
            fn = self._wrapped[name] = self._watch.wrap(f"core.{name}", value)
        return fn


def start(wrapper) -> bool:
    """Installs the watch in this worker's process once (the collections' callback, the wrapped step calls), then
    zeroes its counters: what `read` returns from here on. Whether hscapture's parts are watched."""
    worker = getattr(wrapper, "worker", wrapper)
    watch = getattr(worker, "_hsbench_watch", None)
    if watch is None:
        watch = Watch()
        worker._hsbench_watch = watch
        gc.callbacks.append(watch.on_gc)
        for name in STEP_CALLS:  # instance attributes: found before the class's methods, wherever vLLM calls them
            fn = getattr(worker, name, None)
            if callable(fn):
                setattr(worker, name, watch.wrap(name, fn))
        cap = getattr(worker, "_hscapture", None)
        if cap is not None and os.environ.get("HSBENCH_WATCH") == "1":
            for name in CAPTURE_PARTS:  # looked up on the instance at every step (`run_step`)
                setattr(cap, name, watch.wrap(f"hscapture.{name}", getattr(cap, name)))
            cap.session = _CoreCalls(watch, cap.session)  # the hooks reach the core through `cap.session` too
    watch.reset()
    return any(k.startswith("hscapture.") for k in watch.calls)


def take_round(wrapper) -> dict | None:
    """The step calls' wall times since the last take (`Watch.take_round`); None without a watch."""
    watch = getattr(getattr(wrapper, "worker", wrapper), "_hsbench_watch", None)
    return watch.take_round() if watch is not None else None


def read(wrapper) -> dict | None:
    """Since `start`: per generation [collections, ms]; per watched call [calls, the engine thread's minor faults in
    them, its CPU ms in them]."""
    watch = getattr(getattr(wrapper, "worker", wrapper), "_hsbench_watch", None)
    return watch.summary() if watch is not None else None
