"""Where the tensor-parallel ranks meet: once at every call of the step protocol (a step's begin, its end,
each flush).

Each rank does its part of the call (a session call that accounts steps), then all ranks all-gather one
record of fixed size: whether this rank's capture has failed, how many steps the call accounted, a
digest of their checksums, and its global rank (to name it). Exactly one all-gather per call on every rank, whatever failed where: a rank
that stopped never leaves the others waiting, and one rank's message is never paired with another kind
of message from a peer. (vLLM 0.23's engine went on scheduling steps after a worker raised, so a
failed rank does meet the others again.)

- A rank whose capture failed (in this call, in a hook of this step, or before) raises its own error.
  Hooks never raise: they keep their error for the step's end, since a rank whose forward stopped would
  leave the others waiting in the model's own collectives. A forward that raised starts its end's meeting
  without waiting for it (``start``: the others may be in the model's collectives instead); the next
  meeting waits for it first.
- The others raise a peer error naming it. It is not recorded for the driver, which reports the failed
  rank's own error.
- Ranks that accounted different numbers of steps, or steps whose checksums differ, raise
  ``RankMismatchError``. Every rank sees the same digests, so all of them then compare step by step
  (the same all-gathers everywhere) to name the first step that differs.
"""

from __future__ import annotations

from typing import Any, Callable

from .errors import HscaptureError, RankMismatchError

_M = (1 << 64) - 1


def digest(outcomes: list) -> int:
    """FNV-1a over the (step, checksum) pairs, as a signed 64-bit integer (what the all-gather carries)."""
    d = 0xCBF29CE484222325
    for step, checksum, *_ in outcomes:
        for v in (int(step), int(checksum)):
            d = ((d ^ (v & _M)) * 0x100000001B3) & _M
    return d - (1 << 64) if d >= 1 << 63 else d


def unexpected(where: str, e: Exception) -> HscaptureError:
    """A non-hscapture exception, typed (its cause kept): what a rank keeps and reports at a meeting."""
    err = HscaptureError(
        f"{where}: an unexpected {type(e).__name__} on this rank: {e}; expected none (a bug in hscapture, or the "
        "machine failing); the run stops here on every rank"
    )
    err.__cause__ = e
    return err


def start(cap: Any) -> None:
    """The meeting of a step whose forward raised: this rank's record (failed, nothing accounted) is sent
    without waiting for the others; the next ``meet`` waits for it first, so the order of meetings is the
    same on every rank."""
    wait_pending(cap)
    if cap.tp.size > 1:
        cap._pending_meeting = cap.tp.start_all_gather_i64s([1, 0, digest([]), int(cap.global_rank)])


def wait_pending(cap: Any) -> None:
    pending, cap._pending_meeting = cap._pending_meeting, None
    if pending is not None:
        pending()  # the others' records: they learn of this rank's failure from it; it already knows


def meet(cap: Any, what: str, call: Callable[[], list]) -> list:
    """Runs ``call`` (unless the capture failed before), meets the other TP ranks and checks the steps it
    accounted; returns them. ``cap`` is a ``WorkerCapture`` (its ``tp``, ``session`` and failure state)."""
    wait_pending(cap)
    outcomes: list = []
    error: BaseException | None = None
    if cap._failure is None:
        try:
            outcomes = call()
        except HscaptureError as e:
            cap._failed(e)
            error = e
        except Exception as e:  # noqa: BLE001 - still meet the others, then raise it typed
            error = unexpected(what, e)
            cap._failed(error)
    failed = int(cap._failure is not None)
    records = []  # one rank: nobody to meet (the per-step path at TP=1 stays as it was)
    if cap.tp.size > 1:
        records = cap.tp.all_gather_i64s([failed, len(outcomes), digest(outcomes), int(cap.global_rank)])
    if error is not None:
        cap._failure_raised = True
        raise error
    if failed:
        if not cap._failure_raised:  # a hook's error, or a forward's: raised as itself, once
            cap._failure_raised = True
            raise cap._failure
        cap._refuse(what)
    peers = [f"tensor-parallel rank {r} (global rank {rec[3]})" for r, rec in enumerate(records) if rec[0]]
    if peers:
        cap._stopped_by_peers(what, peers)
    if not records:
        return outcomes
    try:
        counts = [rec[1] for rec in records]
        if len(set(counts)) > 1:
            raise RankMismatchError(
                f"{what}: the tensor-parallel ranks accounted different numbers of steps (per rank {counts}); "
                "expected the same, since every rank captures the same way (checked at start-up). This is a bug "
                "in hscapture: please report it with the workers' logs"
            )
        if len({rec[2] for rec in records}) > 1:
            for step, checksum, *_ in outcomes:
                cap.session.verify_ranks(step, "tensor-parallel", cap.tp.all_gather_i64(checksum))
            raise RankMismatchError(
                f"{what}: the tensor-parallel ranks' digests of steps {[o[0] for o in outcomes]} differ, but no "
                "single step's checksum did; expected equal digests. This is a bug in hscapture: please report it"
            )
    except HscaptureError as e:
        cap._failed(e)
        raise
    return outcomes
