"""Where a worker's thread spends each step's host time, by part of the step protocol, Python and core together (the
core's own share is in the session's stats): the host cost of a step, measured where it is spent."""

from __future__ import annotations

PARTS = ("begin", "before_forward", "hooks", "end")

SLOW_NS = 1_000_000
"""A part longer than this (1 ms) in one step is counted as a slow step of that part."""


class StepTimes:
    """``ns``: nanoseconds per part over every step (``steps`` of them); ``before_forward`` and ``hooks`` add up inside
    the forward (``WorkerCapture``), ``begin`` and ``end`` are added by ``step``. ``slow``: per part, the steps in which
    it took over ``SLOW_NS`` and their nanoseconds, which tell an average that every step pays from a few long steps
    (a wait, a first launch) spread over all."""

    def __init__(self) -> None:
        self.ns = {"steps": 0, **{p: 0 for p in PARTS}}
        self.slow = {p: [0, 0] for p in PARTS}

    def mark(self) -> tuple[int, int]:
        """Before a step: what the forward's parts stand at."""
        return self.ns["before_forward"], self.ns["hooks"]

    def step(self, mark: tuple[int, int], begin_ns: int, end_ns: int) -> None:
        """A step ended: its begin and end, and its forward's parts since ``mark``."""
        ns = self.ns
        ns["steps"] += 1
        ns["begin"] += begin_ns
        ns["end"] += end_ns
        forward, hooks = ns["before_forward"] - mark[0], ns["hooks"] - mark[1]
        if max(begin_ns, forward, hooks, end_ns) <= SLOW_NS:
            return  # every step but a rare one: nothing more to count, nothing allocated
        for part, t in zip(PARTS, (begin_ns, forward, hooks, end_ns), strict=True):
            if t > SLOW_NS:
                self.slow[part][0] += 1
                self.slow[part][1] += t

    def stats(self) -> dict:
        """``host_ns_<part>`` (and ``host_ns_steps``), ``host_slow_<part>``: [steps, ns]."""
        return {
            **{f"host_ns_{k}": v for k, v in self.ns.items()},
            **{f"host_slow_{k}": list(v) for k, v in self.slow.items()},
        }
