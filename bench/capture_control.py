"""What `bench/gpu_run.py` does to the worker's capture between timed rounds, through `collective_rpc` (each function
runs in the worker's process; it travels there by reference, bench/ being on the worker's path too): the `_ab`/`_abc`
modes' pause, hook removal, close and rebuild, and the `_nice` mode's lower priority for the writer threads."""

from __future__ import annotations


def renice_writers(worker) -> int:
    """Lowers the capture's writer threads to nice 10 (Linux: a thread's own priority), so that the engine's threads win
    every core they want: does the writers' competition for cores cost the engine's step? Returns how many."""
    import os

    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                if not f.read().startswith("hscapture-write"):
                    continue
            os.setpriority(os.PRIO_PROCESS, int(t), 10)
            n += 1
        except OSError:  # a thread that ended meanwhile
            continue
    return n


def capture_worker(obj):
    """The worker itself: a function sent through ``collective_rpc`` is given vLLM's ``WorkerWrapperBase``, which
    reads through to its worker (``__getattr__``) but keeps what is set on it, where the worker never sees it."""
    inner = vars(obj).get("worker")
    return inner if inner is not None else obj


def pause_capture(worker, paused: bool) -> bool:
    """The `_ab` modes: the worker's capture paused (its steps run as vLLM's own; hooks stay, disarmed) or resumed,
    between rounds, after a drain left no step in flight."""
    worker = capture_worker(worker)
    if getattr(worker, "_hscapture", None) is None:
        return False
    worker._hscapture_paused = paused
    return True


def unhook_capture(worker) -> int:
    """The `_abc` modes' third round of a cycle: the capture paused and its layer hooks removed (its session, threads
    and pinned memory stay): what the disarmed hooks cost. The hooks removed."""
    worker = capture_worker(worker)
    cap = getattr(worker, "_hscapture", None)
    if cap is None:
        return 0
    worker._hscapture_paused = True
    n = len(cap.handles)
    for h in cap.handles:
        h.remove()
    cap.handles = []
    return n


def close_capture(worker) -> dict:
    """The `_abc` modes' last round of a cycle: the worker's capture closed and dropped from the worker (its hooks
    removed, its writer threads joined, the runner's order wrapper taken off), vLLM's connector plumbing and the worker
    class staying. ``freed``: nothing kept the closed capture (its session, pinned buffers, device arena) alive after a
    collection. The process's threads before and after."""
    import gc
    import weakref

    import psutil

    worker, me = capture_worker(worker), psutil.Process()
    before = me.num_threads()
    cap, worker._hscapture = getattr(worker, "_hscapture", None), None
    gone = None
    if cap is not None:
        cap.close()
        gone = weakref.ref(cap)
        del cap
        gc.collect()
    return {"threads_before": before, "threads_after": me.num_threads(), "freed": gone is not None and gone() is None}


def reopen_capture(worker) -> None:
    """The `_abc` modes: a closed capture built again as the worker built it at start-up (hooks, session, threads,
    the order wrapper on the runner), running (not paused)."""
    from hscapture.adapters.requested import capture_config

    worker = capture_worker(worker)
    if getattr(worker, "_hscapture", None) is None:
        worker._hscapture = worker.capture_cls.from_worker(worker, capture_config(worker.vllm_config))
    worker._hscapture_paused = False
