"""The step protocol's host times: totals per part, and the steps in which a part took over 1 ms counted apart
(``capture/step_times.py``), as ``run_step`` records them around a step."""

from __future__ import annotations

import time

from hscapture.capture.step_times import SLOW_NS, StepTimes
from hscapture.capture.worker_capture import run_step


def test_a_part_over_the_threshold_counts_as_a_slow_step_of_that_part_only():
    t = StepTimes()
    mark = t.mark()
    t.ns["hooks"] += 3 * SLOW_NS  # one step's hooks, added up inside its forward
    t.ns["before_forward"] += 10_000
    t.step(mark, 20_000, SLOW_NS + 1)
    mark = t.mark()
    t.ns["hooks"] += 50_000
    t.step(mark, 30_000, 40_000)
    assert t.ns == {
        "steps": 2,
        "begin": 50_000,
        "before_forward": 10_000,
        "hooks": 3 * SLOW_NS + 50_000,
        "end": SLOW_NS + 40_001,
    }
    assert t.slow == {"begin": [0, 0], "before_forward": [0, 0], "hooks": [1, 3 * SLOW_NS], "end": [1, SLOW_NS + 1]}
    st = t.stats()
    assert st["host_ns_steps"] == 2 and st["host_slow_hooks"] == [1, 3 * SLOW_NS] and st["host_slow_begin"] == [0, 0]


class _Capture:
    """What run_step drives: begin, end, abandon, and the times."""

    def __init__(self, begin_s: float, end_s: float) -> None:
        self.times, self.begin_s, self.end_s = StepTimes(), begin_s, end_s
        self.host_ns = self.times.ns

    def begin(self, _so) -> None:
        time.sleep(self.begin_s)

    def end(self) -> None:
        time.sleep(self.end_s)

    def abandon(self, _e) -> None:
        raise AssertionError("the step did not fail")


class _Worker:
    def __init__(self, cap: _Capture) -> None:
        self._hscapture = cap


def test_run_step_times_each_part_and_counts_the_slow_ones():
    cap = _Capture(begin_s=0.0, end_s=0.003)

    def forward(_so):  # the hooks' time adds up inside the forward, as WorkerCapture's hooks add theirs
        cap.host_ns["hooks"] += 2 * SLOW_NS
        return "out"

    assert run_step(_Worker(cap), forward, object()) == "out"
    assert run_step(_Worker(cap), lambda _so: "out", object()) == "out"
    assert cap.times.ns["steps"] == 2
    assert cap.times.slow["hooks"] == [1, 2 * SLOW_NS]  # the second step's forward ran no hook
    assert cap.times.slow["end"][0] == 2 and cap.times.slow["end"][1] >= 2 * 3_000_000
    assert cap.times.slow["begin"] == [0, 0]
    assert cap.times.ns["end"] >= 6_000_000
