"""The tensor-parallel ranks in step, and the capture's failure state: one ``RankSync`` per capture.

The ranks meet exactly once at every call of the step protocol (a step's begin, its end, each flush):
each rank does its part of the call (a session call that accounts steps), then all of them all-gather
one record of fixed size — whether this rank's capture has failed, how many steps the call accounted, a
digest of their checksums, and its global rank (to name it). Exactly one all-gather per call on every
rank, whatever failed where: a rank that stopped never leaves the others waiting, and one rank's message
is never paired with another kind of message from a peer. (vLLM 0.23's engine went on scheduling steps
after a worker raised, so a failed rank does meet the others again.)

The failure state: the capture's first error (``failure``) refuses every later step and result. A rank's
own error is raised once as itself, then as a refusal naming it, and recorded for the driver (vLLM only
reports that the engine died: ``failures.py``). A peer's failure is a ``PeerFailedError`` naming the rank,
never recorded: the driver reports the failed rank's own error.

- Hooks never raise: they keep their error for the step's end, since a rank whose forward stopped would
  leave the others waiting in the model's own collectives. A forward that raised starts its end's meeting
  without waiting for it (``start_failed``: the others may be in the model's collectives instead); the next
  meeting waits for it first.
- Ranks that accounted different numbers of steps, or steps whose checksums differ, raise
  ``RankMismatchError``. Every rank sees the same digests, so all of them then compare step by step (the
  same all-gathers everywhere) to name the first step that differs.

What a rank sends and what the gathered records mean is decided in the core (``ranks/meeting.rs``); this module
carries the records between ranks and keeps the failure state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import _native
from ..errors import HscaptureError, PeerFailedError
from ..output import failures


def unexpected(where: str, e: Exception) -> HscaptureError:
    """A non-hscapture exception, typed (its cause kept): what a rank keeps and reports at a meeting."""
    err = HscaptureError(
        f"{where}: an unexpected {type(e).__name__} on this rank: {e}; expected none (a bug in hscapture, or the "
        "machine failing); the run stops here on every rank"
    )
    err.__cause__ = e
    return err


class RankSync:
    """``tp``: the tensor-parallel group (``vllm_compat.TPGroup`` or a stand-in with ``size``, ``rank``,
    ``all_gather_i64s``, ``start_all_gather_i64s``, ``all_gather_i64``); ``global_rank`` names this rank;
    ``out``: where a failure is recorded for the driver (None: nowhere)."""

    def __init__(self, tp: Any, global_rank: int = 0, out: str | None = None) -> None:
        self.tp = tp
        self.global_rank = int(global_rank)
        self.out = out
        self.failure: HscaptureError | None = None  # the first error of this capture (it refuses all after)
        self._raised = False  # whether that first error was raised once already, as itself
        self._pending: Any = None  # a meeting started by `start_failed`, waited for by the next one

    # -- the failure state -------------------------------------------------------------------
    def failed(self, e: HscaptureError) -> None:
        """Keeps the first error (raised as itself at the next meeting, refused after) and records this
        rank's own error for the driver."""
        if self.failure is None:
            self.failure, self._raised = e, False
        failures.record_failure(self.out, self.global_rank, e)

    def raised(self, e: HscaptureError) -> None:
        """``e`` is propagating now: it is the failure, already raised once."""
        self.failed(e)
        self._raised = True

    def refuse(self, what: str) -> None:
        """After a failure nothing goes on: vLLM may keep scheduling steps after a worker raised (0.23's batch
        queue went on for four more steps), and a driver must never get a successful result from a run that
        lost a step."""
        e = self.failure
        if isinstance(e, PeerFailedError):
            raise PeerFailedError(f"{what} refused: {e.peers} failed at an earlier step{_PEER_TAIL}")
        raise type(e)(
            f"{what} refused: this rank (rank {self.global_rank}) failed earlier, so the capture has a gap; "
            f"expected no failure, found: {e}. Fix that and re-run: complete samples already on disk are kept and "
            "the re-run resumes after them"
        ) from e

    def check(self, what: str) -> None:
        """Raises the failure (as itself the first time, as a refusal after); returns if there is none."""
        if self.failure is None:
            return
        if not self._raised:
            self._raised = True
            raise self.failure
        self.refuse(what)

    # -- meetings ------------------------------------------------------------------------------
    def start_failed(self) -> None:
        """The meeting of a step whose forward raised: this rank's record (failed, nothing accounted) is
        sent without waiting for the others; the next ``meet`` waits for it first, so the order of
        meetings is the same on every rank."""
        self._wait_pending()
        if self.tp.size > 1:
            self._pending = self.tp.start_all_gather_i64s(_native.meeting_record(True, [], self.global_rank))

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending()  # the others learn of this rank's failure from it; it already knows

    def meet(self, what: str, call: Callable[[], list], session: Any = None) -> list:
        """Runs ``call`` (unless the capture failed before), meets the other TP ranks and checks the steps
        it accounted; returns them. ``session`` compares step checksums when the digests differ."""
        self._wait_pending()
        outcomes: list = []
        error: HscaptureError | None = None
        if self.failure is None:
            try:
                outcomes = call()
            except HscaptureError as e:
                error = e
            except Exception as e:  # noqa: BLE001 - still meet the others, then raise it typed
                error = unexpected(what, e)
            if error is not None:
                self.raised(error)
        records = []  # one rank: nobody to meet (the per-step path at TP=1 stays as it was)
        if self.tp.size > 1:
            steps = [(int(o[0]), int(o[1])) for o in outcomes]
            records = self.tp.all_gather_i64s(_native.meeting_record(self.failure is not None, steps, self.global_rank))
        if error is not None:
            raise error
        self.check(what)
        if records:
            self._decide(what, outcomes, records)
        return outcomes

    def _decide(self, what: str, outcomes: list, records: list) -> None:
        try:
            verdict, peers = _native.decide_meeting(what, records)
            if verdict == "compare_steps":  # the same all-gathers on every rank: each saw the same digests
                gathered = [(int(o[0]), self.tp.all_gather_i64(int(o[1]))) for o in outcomes]
                _native.compare_steps(what, gathered)  # raises, naming the first step that differs
        except HscaptureError as e:
            self.raised(e)
            raise
        if verdict == "peers_failed":
            e = PeerFailedError(f"{what} refused: {peers} failed{_PEER_TAIL}")
            e.peers = peers
            self.failure, self._raised = e, True  # not recorded: their own error is the root cause
            raise e

    # -- start-up --------------------------------------------------------------------------------
    def agree_on_path(self, path: str, overlap: int, failure: HscaptureError | None = None) -> None:
        """Every TP rank must capture the same way: device steps are accounted later than host steps (and
        later still with overlap), so ranks on different paths would compare the checksums of different
        steps, or wait for each other forever at the end. Refused at start-up, naming ranks. A rank whose
        set-up failed (``failure``) still takes part, so that no rank waits for it."""
        if self.tp.size <= 1:
            if failure is not None:
                raise failure
            return
        codes = self.tp.all_gather_i64(_native.path_code(path, overlap))
        failed = _native.agree_on_paths(codes) if failure is None else None  # raises when the paths differ
        if failure is not None:
            raise failure
        if failed is not None:
            e = PeerFailedError(
                f"{failed} could not set up their capture path (their logs say why); expected every rank to start, so "
                "this rank stops too"
            )
            e.peers = failed
            raise e


_PEER_TAIL = (
    " (the driver reports their own error; their logs have it); expected every rank to be capturing, so this rank "
    "stops with them"
)
