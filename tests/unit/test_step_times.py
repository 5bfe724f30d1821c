"""The step protocol's host times: totals per part, and the steps in which a part took over 1 ms counted apart
(``capture/step_times.py``), as ``run_step`` records them around a step."""

from __future__ import annotations

from hscapture.capture import worker_capture
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


class _Clock:
    """``run_step``'s clock, advanced only by the fake capture: the parts' times are exact, whatever else this
    machine runs (a real sleep on a loaded CI core once made a zero-length ``begin`` take 4 ms)."""

    def __init__(self) -> None:
        self.now = 0

    def perf_counter_ns(self) -> int:
        return self.now


class _Capture:
    """What run_step drives: begin, end, abandon, and the times; each takes the clock's nanoseconds it is given."""

    def __init__(self, clock: _Clock, begin_ns: int, end_ns: int) -> None:
        self.times, self.clock, self.begin_ns, self.end_ns = StepTimes(), clock, begin_ns, end_ns
        self.host_ns = self.times.ns

    def begin(self, _so) -> None:
        self.clock.now += self.begin_ns

    def end(self) -> None:
        self.clock.now += self.end_ns

    def abandon(self, _e) -> None:
        raise AssertionError("the step did not fail")


class _Worker:
    def __init__(self, cap: _Capture) -> None:
        self._hscapture = cap


def test_run_step_times_each_part_and_counts_the_slow_ones(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(worker_capture, "time", clock)
    cap = _Capture(clock, begin_ns=SLOW_NS // 2, end_ns=3 * SLOW_NS)

    def forward(_so):  # the hooks' time adds up inside the forward, as WorkerCapture's hooks add theirs
        cap.host_ns["hooks"] += 2 * SLOW_NS
        clock.now += 7 * SLOW_NS  # the forward's own time is no part of the capture's
        return "out"

    assert run_step(_Worker(cap), forward, object()) == "out"
    assert run_step(_Worker(cap), lambda _so: "out", object()) == "out"
    assert cap.times.ns == {
        "steps": 2,
        "begin": SLOW_NS,
        "before_forward": 0,
        "hooks": 2 * SLOW_NS,
        "end": 6 * SLOW_NS,
    }
    assert cap.times.slow == {
        "begin": [0, 0],
        "before_forward": [0, 0],
        "hooks": [1, 2 * SLOW_NS],  # the second step's forward ran no hook
        "end": [2, 6 * SLOW_NS],
    }
