"""Feeding prompts to vLLM's engine as a stream: at most ``window`` requests in flight, rows read from the input
when their request is sent (a 50,000-row dataset is never held as Python lists), each finished request
reported as it finishes (progress, legacy conversion). vLLM's own progress bar is not used.

Uses ``LLM.llm_engine``'s public ``add_request`` / ``step`` / ``has_unfinished_requests``, the loop that
``LLM.generate`` runs itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..adapters.vllm_compat import SAMPLE_KEY

PREFIX = "hs-"


def index_of(request_id: str) -> int | None:
    """The row of a request this driver sent (``hs-{i}``, vLLM may append a suffix)."""
    if not request_id.startswith(PREFIX):
        return None
    head = request_id[len(PREFIX) :].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def drive(
    llm,
    prompts,
    rows: Iterable[int],
    on_finished: Callable[[int, int], None],
    window: int = 1024,
    extra_args: Callable[[int], dict] | None = None,
) -> int:
    """Sends ``prompts[i]`` for each ``i`` of ``rows`` (``max_tokens=1``; ``extra_args(i)`` for the workers, by
    default the row as the sample index) and steps the engine until all finished; ``on_finished(i,
    prompt_length)`` per finished request. Returns the count."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    it = iter(rows)
    sent: dict[str, int] = {}
    done = 0

    def fill() -> None:
        while len(sent) < window:
            i = next(it, None)
            if i is None:
                return
            rid = f"{PREFIX}{i}"
            params = SamplingParams(
                max_tokens=1, detokenize=False, extra_args=extra_args(i) if extra_args else {SAMPLE_KEY: i}
            )
            engine.add_request(rid, {"prompt_token_ids": prompts[i]}, params)
            sent[rid] = i

    fill()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            i = sent.pop(out.request_id, None)
            if i is None:
                i = index_of(out.request_id)
                sent.pop(f"{PREFIX}{i}", None)
            done += 1
            on_finished(i, len(out.prompt_token_ids or ()))
        fill()
    return done
