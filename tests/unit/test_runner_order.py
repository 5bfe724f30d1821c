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


def test_the_step_is_prepared_before_its_forward_v2():
    """hscapture plans (and on a GPU arms) each step right after the runner prepared it: a replayed CUDA graph calls
    no hook that could do it later."""
    seen = []
    runner = V2Runner([("a", 2), ("b", 3)])
    o = RunnerOrder(runner, before_forward=lambda: seen.append(o.order()))
    assert o.pre_forward
    batch = runner.prepare_inputs("so")
    assert seen == [["a", "b"]] and batch.req_ids == ["a", "b"], "the runner still gets its own batch"


def test_the_step_is_prepared_before_its_forward_v1():
    seen = []

    class V1Runner:
        input_batch = SimpleNamespace(req_ids=["b", "a"], num_reqs=2)

        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
            return ("logits", num_scheduled_tokens)

    runner = V1Runner()
    o = RunnerOrder(runner, before_forward=lambda: seen.append(o.order()))
    assert o.pre_forward and runner._prepare_inputs("so", 3) == ("logits", 3)
    assert seen == [["b", "a"]]
    bare = RunnerOrder(SimpleNamespace(input_batch=V1Runner.input_batch))
    assert not bare.pre_forward, "no step preparation to follow: CUDA graphs are refused (wiring.check_graphs)"


# What hscapture reads of Model Runner V2, as vLLM 0.34's source has it (vllm/v1/worker/gpu/input_batch.py,
# model_runner.py): the InputBatch fields, and `execute_model` preparing the step before its forward (eager call,
# PIECEWISE graphs and the FULL graph's replay alike).
V2_FIELDS_034 = ("req_ids", "num_reqs", "num_scheduled_tokens", "query_start_loc_np")


def test_v2_order_is_read_from_vllms_own_input_batch():
    """The installed vLLM's own `InputBatch` (0.16 and the newest CPU build have Model Runner V2's): built by its
    `make_dummy`, read by RunnerOrder; its fields are those vLLM 0.34 has."""
    import dataclasses
    import inspect

    import torch

    ib = pytest.importorskip("vllm.v1.worker.gpu.input_batch")
    fields = {f.name for f in dataclasses.fields(ib.InputBatch)}
    assert set(V2_FIELDS_034) <= fields, f"vLLM's InputBatch lacks {set(V2_FIELDS_034) - fields}"
    buffers = ib.InputBuffers(max_num_reqs=4, max_num_tokens=16, device=torch.device("cpu"))
    kwargs = (
        {"device": torch.device("cpu")} if "device" in inspect.signature(ib.InputBatch.make_dummy).parameters else {}
    )
    batch = ib.InputBatch.make_dummy(3, 7, buffers, **kwargs)

    class Runner:
        def prepare_inputs(self, *args):
            return batch

    r = Runner()
    o = RunnerOrder(r)
    r.prepare_inputs("so")
    counts = dict(zip(batch.req_ids, (int(x) for x in batch.num_scheduled_tokens), strict=True))
    assert o.order(counts) == list(batch.req_ids) and sum(counts.values()) == 7


def test_v2_execute_model_prepares_the_step_before_its_forward():
    import inspect

    mr = pytest.importorskip("vllm.v1.worker.gpu.model_runner")
    src = inspect.getsource(mr.GPUModelRunner.execute_model)
    prepared = src.index("self.prepare_inputs(")
    forwards = [i for i in (src.find("self.model("), src.find("run_fullgraph"), src.find("run_pw_graph")) if i >= 0]
    assert forwards and prepared < min(forwards), "Model Runner V2 runs a forward before preparing the step"


def test_closing_puts_the_runners_method_back_and_a_new_order_wraps_it_once():
    """A reload closes the capture and builds a new one on the same runner: the old wrapper must neither reach the
    closed capture nor sit under the new one."""
    calls = []
    runner = V2Runner([("a", 2)])
    first = RunnerOrder(runner, before_forward=lambda: calls.append("first"))
    assert "prepare_inputs" in vars(runner)
    first.close()
    assert "prepare_inputs" not in vars(runner), "the class's own method is back"
    assert first.before_forward is None
    second = RunnerOrder(runner, before_forward=lambda: calls.append("second"))
    runner.prepare_inputs("so")
    assert calls == ["second"] and second.order() == ["a"]
    second.close()
    second.close()  # twice is harmless
    assert "prepare_inputs" not in vars(runner)


def test_closing_under_another_wrapper_leaves_it_in_place_and_inert():
    calls = []
    runner = V2Runner([("a", 2)])
    ours = RunnerOrder(runner, before_forward=lambda: calls.append("ours"))
    inner = runner.prepare_inputs

    def theirs(*args):  # something wrapped the runner after us
        calls.append("theirs")
        return inner(*args)

    runner.prepare_inputs = theirs
    ours.close()
    assert runner.prepare_inputs is theirs, "an outer wrapper is never cut off"
    runner.prepare_inputs("so")
    assert calls == ["theirs"] and ours._batch is None


def test_an_instance_method_set_before_us_is_restored_as_it_was():
    runner = V2Runner([("a", 2)])
    own = runner.prepare_inputs
    runner.prepare_inputs = own  # already an instance attribute (another plugin, an earlier patch)
    o = RunnerOrder(runner, before_forward=lambda: None)
    o.close()
    assert vars(runner)["prepare_inputs"] is own
