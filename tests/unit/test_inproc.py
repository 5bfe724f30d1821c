"""A finished request's generated tokens handed straight to a worker's capture in the same process and thread
(``capture/inproc.py``): the sample completes at once, in a step without rows, and the next scheduler output that
reports the request finished again changes nothing; where that cannot be done the caller keeps the metadata path."""

from __future__ import annotations

import gc
import threading
from types import SimpleNamespace

import torch
from test_rpc import Runner
from test_session import H, rows_tagged

from hscapture import _native
from hscapture.adapters.vllm_compat import RunnerOrder
from hscapture.capture import inproc
from hscapture.capture.ranksync import RankSync
from hscapture.capture.worker_capture import WorkerCapture
from hscapture.config import CaptureConfig
from support import new_req, sched

LAYERS = (1, 3)
META = SimpleNamespace(hscapture=True, outputs={})


class Config:
    """A stand-in for vLLM's config (weakly referenced, as a VllmConfig can be)."""


def capture(tp_size: int = 1) -> tuple[WorkerCapture, Runner]:
    runner = Runner()
    session = _native.CaptureSession(list(LAYERS), "after", 4, H, "float32", "float32", assemble=True)
    cfg = CaptureConfig(layers=LAYERS, convention="after")
    sync = RankSync(SimpleNamespace(size=tp_size, rank=0), 0, None)
    return WorkerCapture(cfg, session, sync, RunnerOrder(runner)), runner


def step(cap: WorkerCapture, runner: Runner, so, order: list[str]) -> None:
    so.kv_connector_metadata = getattr(so, "kv_connector_metadata", META)
    runner.lay_out(order)
    cap.begin(so)
    for slot in range(len(LAYERS) if so.total_num_scheduled_tokens else 0):  # an empty step runs no forward
        h = rows_tagged(slot, so.total_num_scheduled_tokens)
        cap.on_capture(slot, h, torch.zeros_like(h))
    cap.end()


def prompt_and_two_decode_steps(cap: WorkerCapture, runner: Runner) -> list[int]:
    """Request `a` (4 prompt tokens, generated tokens captured) prefilled, then two decode steps; its tokens through a
    forward."""
    r = new_req("a", [5, 6, 7, 8], 0, max_tokens=3)
    r.sampling_params.extra_args["kv_transfer_params"] = {"include_output_tokens": True}
    step(cap, runner, sched(new=[r], n={"a": 4}), ["a"])
    step(cap, runner, sched(cached=[("a", 4)], n={"a": 1}), ["a"])
    step(cap, runner, sched(cached=[("a", 5)], n={"a": 1}), ["a"])
    return [5, 6, 7, 8, 11, 12]


def test_the_sample_completes_at_once_and_a_later_report_changes_nothing():
    cap, runner = capture()
    tokens = prompt_and_two_decode_steps(cap, runner)
    assert cap.session.take_samples() == []  # the workers do not know yet that `a` finished
    assert inproc.finish_outputs(cap, {"a": tokens}) is True
    (sample,) = cap.session.take_samples()
    assert sample["request_id"] == "a" and sample["token_ids"] == tokens
    assert sample["shape"][0] == len(tokens)
    # The engine's next step reports `a` finished (without tokens: the connector handed them over already).
    step(cap, runner, sched(finished=["a"]), [])
    assert cap.session.take_samples() == []
    cap.close()


def test_not_in_a_step_in_progress_nor_with_other_ranks_to_meet():
    cap, runner = capture()
    prompt_and_two_decode_steps(cap, runner)
    runner.lay_out([])
    cap.begin(sched(cached=[], n={}))
    assert inproc.finish_outputs(cap, {"a": [5, 6, 7, 8, 11, 12]}) is False  # the metadata will carry them
    cap.end()
    cap.close()
    tp2, _ = capture(tp_size=2)
    assert inproc.finish_outputs(tp2, {"a": [1]}) is False
    tp2.session.finish()


def test_found_only_for_its_own_engine_on_the_thread_that_steps_it():
    cap, runner = capture()
    config, other = Config(), Config()
    inproc.register(config, cap)
    assert inproc.capture_for(config) is None  # no step yet: the thread that steps it is unknown
    step(cap, runner, sched(), [])
    assert inproc.capture_for(config) is cap
    assert inproc.capture_for(other) is None
    seen = []
    t = threading.Thread(target=lambda: seen.append(inproc.capture_for(config)))
    t.start()
    t.join()
    assert seen == [None]  # another thread: a step of the engine may be running
    cap.close()  # unregisters
    assert inproc.capture_for(config) is None
    again, runner = capture()
    inproc.register(config, again)
    step(again, runner, sched(), [])
    assert inproc.capture_for(config) is again
    again.session.finish()
    del again
    gc.collect()
    assert inproc.capture_for(config) is None  # gone without a close: nothing kept alive


def test_a_closed_capture_is_freed_though_the_runner_lives_on():
    """The runner outlives the capture (a reload builds the next one on it): once closed, nothing it holds may keep
    the capture's session, pinned buffers or device arena alive, and no cycle may (vLLM freezes its start-up heap)."""
    import weakref

    class PreparingRunner(Runner):
        def _prepare_inputs(self, *args):
            return args

    runner = PreparingRunner()
    session = _native.CaptureSession(list(LAYERS), "after", 4, H, "float32", "float32", assemble=True)
    cfg = CaptureConfig(layers=LAYERS, convention="after")
    sync = RankSync(SimpleNamespace(size=1, rank=0), 0, None)
    cap = WorkerCapture(cfg, session, sync, RunnerOrder(runner))
    cap.order.before_forward = cap.before_forward  # as wiring.py wires it
    prompt_and_two_decode_steps(cap, runner)
    gone = weakref.ref(cap)
    gc.freeze()  # as vLLM's engine freezes its start-up heap: only reference counts can free the capture
    try:
        cap.close()
        del cap, session
        gc.collect()
        assert gone() is None, "a closed capture is still held (a cycle through it, or the runner's wrapper)"
    finally:
        gc.unfreeze()
    runner._prepare_inputs("so")  # the runner still runs, unwrapped
    assert "_prepare_inputs" not in vars(runner)
