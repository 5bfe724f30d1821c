"""One step of a worker with capture: the bracket around ``execute_model``.

Shared by ``CaptureWorker`` (a class override) and the speculators-compatible extension (which can
only wrap the worker instance's method). It also tolerates a single-phase driver: one written for
vLLM ≤ 0.11 never calls ``sample_tokens`` after an ``execute_model`` that returned ``None``; the V1
model runner then refuses the next ``execute_model``. The pending ``sample_tokens`` is completed first
(its result is discarded: such a driver never reads it).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger("hscapture")
_warned = False


def complete_pending_sample(worker: Any) -> bool:
    """Runs the ``sample_tokens`` a single-phase driver skipped; True if one was pending."""
    global _warned
    runner = getattr(worker, "model_runner", None)
    if getattr(runner, "execute_model_state", None) is None:
        return False
    if not _warned:
        log.warning("hscapture: the driver skipped sample_tokens() after execute_model(); completing it "
                    "(a single-phase driver written for vLLM <= 0.11)")
        _warned = True
    worker.sample_tokens(None)
    return True


def run_step(worker: Any, call: Callable[..., Any], scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
    """``call(scheduler_output, ...)`` (the base ``execute_model``) bracketed by the worker's capture."""
    complete_pending_sample(worker)
    cap = getattr(worker, "_hscapture", None)
    if cap is None or getattr(worker, "_hscapture_paused", False):
        return call(scheduler_output, *args, **kwargs)
    cap.begin(scheduler_output)
    try:
        out = call(scheduler_output, *args, **kwargs)
    except BaseException as e:
        cap.abandon(e)
        raise
    cap.end()
    return out
