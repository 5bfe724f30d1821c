"""The step order comes from the runner that ran the step: V1's persistent batch, or the batch Model Runner V2
built for this step (it sorts requests itself). Anything unreadable is refused, never guessed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from hscapture import AttributionError, CompatibilityError
from hscapture.adapters.vllm_compat import RunnerOrder


class V2Runner:
    """What hscapture relies on in Model Runner V2: `prepare_inputs` returns the step's `InputBatch`."""

    def __init__(self, layout):
        self.layout = layout

    def prepare_inputs(self, scheduler_output, *rest):
        ids, counts = zip(*self.layout, strict=True)
        starts = np.concatenate([[0], np.cumsum(counts)])
        return SimpleNamespace(
            req_ids=list(ids), num_reqs=len(ids), num_scheduled_tokens=np.array(counts), query_start_loc_np=starts
        )


def test_v1_reads_the_persistent_batch():
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["b", "a", None], num_reqs=2))
    o = RunnerOrder(runner)
    assert o.kind == "v1" and o.order() == ["b", "a"]


def test_v2_reads_the_batch_of_this_step_only():
    # V2 puts decodes first, then prefills by size: not the scheduler's order.
    runner = V2Runner([("d", 1), ("p2", 3), ("p1", 9)])
    o = RunnerOrder(runner)
    assert o.kind == "v2"
    runner.prepare_inputs("so")
    assert o.order({"p1": 9, "d": 1, "p2": 3}) == ["d", "p2", "p1"]
    o.reset()  # the next step: until the runner prepares it, its order is unknown
    with pytest.raises(CompatibilityError, match="without calling `prepare_inputs`"):
        o.order()


def test_v2_batches_that_disagree_with_the_scheduler_or_are_not_contiguous_are_refused():
    runner = V2Runner([("a", 2), ("b", 3)])
    o = RunnerOrder(runner)
    runner.prepare_inputs("so")
    with pytest.raises(AttributionError, match="does not hold the tokens the scheduler scheduled"):
        o.order({"a": 2, "b": 4})
    b = runner.prepare_inputs("so")
    b.query_start_loc_np = np.array([0, 2, 6])
    o._batch = b
    with pytest.raises(CompatibilityError, match="non-contiguously"):
        o.order()


def test_an_unknown_runner_is_refused():
    with pytest.raises(CompatibilityError, match="neither `input_batch`"):
        RunnerOrder(SimpleNamespace())
