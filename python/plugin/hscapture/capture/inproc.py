"""A request's generated tokens handed to the capture as it finishes, where vLLM's scheduler and the worker share a
process and a thread: an engine in the caller's process (``LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with its
one worker in it.

A request that captures its generated tokens (``include_output_tokens``) completes when the workers learn its token
ids, which the connector sends with the next step's scheduler output. An engine of its own process always steps once
more to report finished requests; an engine in the caller's process steps only inside ``generate``, so after a call's
last request no step comes: its file would wait for the next call while its client waits for the file. There the
connector hands the tokens to the worker's capture at once, which completes the sample in a step of its own without
rows (``finish_outputs`` below).

Every other layout keeps the connector's metadata: the workers of another process (TP or PP over several processes)
are not reachable from here, and an engine of its own process reports finished requests in the step it always runs.
"""

from __future__ import annotations

import threading
import weakref
from types import SimpleNamespace
from typing import Any

# id(vllm_config) -> (the config, the worker's capture), both held weakly: an engine dropped without a shutdown leaves
# nothing alive here, and an id reused by a later config finds a dead reference.
_registered: dict[int, tuple[weakref.ref, weakref.ref]] = {}
_lock = threading.Lock()


def register(vllm_config: Any, cap: Any) -> None:
    """The capture of a worker whose engine runs in this process (``wiring.build``)."""
    with _lock:
        for k in [k for k, (vc, c) in _registered.items() if vc() is None or c() is None]:
            del _registered[k]
        _registered[id(vllm_config)] = (weakref.ref(vllm_config), weakref.ref(cap))


def unregister(cap: Any) -> None:
    with _lock:
        for k in [k for k, (_vc, c) in _registered.items() if c() is cap]:
            del _registered[k]


def capture_for(vllm_config: Any) -> Any:
    """The capture of this engine's worker when it runs in this process and its steps run on this thread (the one
    that stepped it last: no step of it can be running now), else None (the connector's metadata then carries the
    tokens)."""
    with _lock:
        entry = _registered.get(id(vllm_config))
    cap = entry[1]() if entry is not None and entry[0]() is vllm_config else None
    if cap is None or cap.step_thread != threading.get_ident():
        return None
    return cap


def finish_outputs(cap: Any, outputs: dict[str, list[int]]) -> bool:
    """Completes these finished requests' samples now, in a step without rows (as the step an engine of its own
    process runs to report them): their rows were all captured by the steps before. False where that cannot be done
    here (a step in progress, other ranks or stages to meet): the connector's metadata then carries them."""
    if cap.link is not None or cap.tp.size != 1 or cap.session.in_step:
        return False
    step = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[], resumed_req_ids=set()),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        finished_req_ids=set(outputs),
        preempted_req_ids=set(),
        kv_connector_metadata=SimpleNamespace(hscapture=True, outputs=dict(outputs)),
    )
    cap.begin(step)
    cap.end()
    return True
