"""Capture on one worker: the per-step protocol around the Rust ``CaptureSession``.

Per step (``execute_model``, bracketed by :func:`run_step`): ``begin`` with the scheduler output; just before the
forward (``before_forward``, called by the runner's step preparation; else the forward's first hook) the order the
runner laid the step out in fixes the plan, and on the device path the step is armed; each hook captures its slot
(under CUDA graphs the replayed graph runs the device launches the hooks recorded); ``end`` checks the contract,
meets the other tensor-parallel ranks (``ranksync.py``) and, once they agree, hands completed samples to the output
(on the writing rank). ``WorkerCapture.from_worker`` wires one
to a vLLM worker (``wiring.py``); the constructor takes the parts, so tests build one without an engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .. import _native
from ..adapters import vllm_compat
from ..config import CaptureConfig
from ..errors import HscaptureError
from . import inproc
from .ranksync import RankSync, unexpected
from .rpc_state import RpcState
from .step_times import StepTimes

log = logging.getLogger("hscapture")


# The raw handle of a device's current CUDA stream, without building a ``torch.cuda.Stream`` (what inductor's
# generated code calls for every launch): a few µs saved in each hook of an eager step. Absent: the public way.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(device_index: int) -> int:
    """The handle of the CUDA stream current on device ``device_index`` (the forward's)."""
    if _RAW_STREAM is not None:
        return int(_RAW_STREAM(device_index))
    return torch.cuda.current_stream(device_index).cuda_stream


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [rows, hidden] where it is a batch of one ([1, tokens, hidden]: a view). Anything else stays as it is
    for the core to refuse by its shape: several hidden states per token ([streams, tokens, hidden], Gemma 3n's
    AltUp) flattened would pass as more rows, the step's tokens read from the first stream alone."""
    if any(d != 1 for d in t.shape[:-2]):
        return t
    return t.flatten(0, -2)


class WorkerCapture:
    """``session``: a ``_native.CaptureSession``; ``sync``: the rank meetings and the failure state;
    ``order``: where the runner's request order is read (``vllm_compat.RunnerOrder``; None when the
    caller plans steps itself); ``writer``: whether this rank assembles and writes."""

    def __init__(
        self,
        cfg: CaptureConfig,
        session: Any,
        sync: RankSync,
        order: Any = None,
        *,
        writer: bool = True,
        link: Any = None,
        model_dtype: str | None = None,
        path: Any = None,
        settle_each_step: bool = False,
        traced_points: tuple[int, ...] | None = None,
    ) -> None:
        self.cfg = cfg
        self.session = session
        self.sync = sync
        self.order = order
        self.writer_rank = writer
        self.link = link  # pipeline.StageLink, under pipeline parallelism
        self.layer_ids = list(session.layer_ids)
        self.point_codes = tuple(session.point_codes())  # each slot's capture point, as the core numbers it
        self.model_dtype = model_dtype  # the activations' (the identity has the stored dtype)
        self.rpc = RpcState(self)  # speculators' RPC surface: the driver's view of each step
        # wiring.DevicePath: how rows leave the GPU ("none" off CUDA), overlapped or not, quantized there for fp8
        self.device_path = getattr(path, "kind", "none")
        self.overlap = int(getattr(path, "overlap", 0))
        self.fp8_on_device = bool(getattr(path, "fp8", False))
        # Per-request files whose clients wait for them, from an engine that may not step again: every device step
        # is collected at its own end instead of the next step's (wiring.py).
        self.settle_each_step = settle_each_step
        self.handles: list[Any] = []  # the hooks on the decoder layers (wiring.install_hooks)
        self.traced_points = traced_points  # under torch.compile: each tap's capture point
        self.traced_taps = 0  # taps of the compiled graph during captured steps
        self.traced_active = False  # this capture is the one the compiled graph's taps call (traced.py)
        self.drain_seconds: dict[str, float] = {}
        self.times = StepTimes()  # this thread's host time per part of the step protocol
        self.host_ns = self.times.ns  # the forward's parts add up here (before_forward, hooks)
        self._active = False
        self._shape_checked: set[int] = set()  # slots whose tensors met the shape contract outside a step
        self.step_thread: int | None = None  # the thread that began the last step (inproc.py)
        self._scheduled: dict[str, int] = {}
        self._total = 0
        self._forward_tokens = 0

    @classmethod
    def from_worker(cls, worker: Any, cfg: CaptureConfig) -> WorkerCapture:
        """The capture of a vLLM worker: its model's facts, the session, the capture path, the hooks."""
        from .wiring import build

        return build(cls, worker, cfg)

    @property
    def tp(self) -> Any:
        return self.sync.tp

    @classmethod
    def points_of(cls, session: Any) -> list[tuple[str, int]]:
        """Where each layer slot of ``session`` is read: ``("embeddings", 0)`` or ``("layer_output", k)``; the hooks
        go there (``wiring.build`` asks the class before it builds the capture)."""
        return session.capture_points()

    def capture_points(self) -> list[tuple[str, int]]:
        return type(self).points_of(self.session)

    def step_order(self) -> list[str]:
        """Request ids in the order the model runner laid out the step being executed."""
        return self.order.order(self._scheduled)

    def _recorded(self, call: Callable[[], Any]) -> Any:
        """``call()``; its error is this capture's failure (recorded for the driver, refused after)."""
        try:
            return call()
        except HscaptureError as e:
            self.sync.raised(e)
            raise

    # -- the step protocol -------------------------------------------------------------------
    def _meet(self, what: str, call: Callable[[], list]) -> list:
        """``call`` (a session call that accounts steps) at a meeting of the TP ranks; once it passed, every step
        accounted so far is agreed on, and only then are its samples stored (``release``)."""
        outcomes = self.sync.meet(what, call)
        self._recorded(self.session.release)
        self._log_notes()
        return outcomes

    def _log_notes(self) -> None:
        for note in self.session.take_notes():  # a stalled writer, a sweep, requests that failed alone
            log.warning("hscapture: %s", note)

    def begin(self, scheduler_output: Any) -> None:
        self.step_thread = threading.get_ident()
        if self.link is not None:
            self.link.new_step()
        try:  # device steps still in flight beyond the one overlap keeps are accounted here
            self._meet("a new step", lambda: self.session.begin_step(vllm_compat.step_of(scheduler_output)))
        except HscaptureError:
            self._abandon()  # this step will not run; the next one must not find it begun
            self._tell_last_stage()
            raise
        self._total = int(scheduler_output.total_num_scheduled_tokens)
        self._forward_tokens = 0
        self._scheduled = dict(scheduler_output.num_scheduled_tokens)
        if self.order is not None:
            self.order.reset()
        self._active = True
        self.rpc.admit(scheduler_output)

    def before_forward(self) -> None:
        """The runner prepared the step's inputs; its forward comes next: the step is planned in the runner's order and,
        on the device path, armed on the forward's stream (a replayed CUDA graph calls no hook that could do it later).
        Errors wait for the step's end, as a hook's do."""
        if not self._active or self.sync.failure is not None or self.session.planned:
            return
        t = time.perf_counter_ns()
        try:
            stream = _current_stream(torch.cuda.current_device()) if self.device_path == "device" else None
            self.session.plan(self.step_order(), stream)
        except HscaptureError as e:
            self.sync.failed(e)
        except Exception as e:  # noqa: BLE001 - kept typed for the step's end
            self.sync.failed(unexpected("planning the step before its forward", e))
        self.host_ns["before_forward"] += time.perf_counter_ns() - t

    def on_positions(self, positions: torch.Tensor) -> None:
        if self._active:
            self._forward_tokens = int(positions.shape[-1])

    def _unshard(self, slot: int, hidden: torch.Tensor, residual: torch.Tensor | None):
        """A residual stream sharded across the TP ranks (sequence-parallel MoE) is gathered, in rank
        order, before capture; a shape that is neither replicated nor that sharding is refused."""
        if hidden.dim() != 2 or hidden.shape[0] >= self._total:  # not rows: the core refuses it by its shape
            return hidden, residual
        where = f"layer id {self.layer_ids[slot]} ({self.cfg.convention} convention, slot {slot})"
        chunk = _native.row_layout(
            int(hidden.shape[0]), self._forward_tokens or self._total, self._total, self.tp.size, self.tp.rank, where
        )
        if chunk is None:
            return hidden, residual
        return self.tp.gather_rows(hidden), (self.tp.gather_rows(residual) if residual is not None else None)

    def on_capture(
        self, slot: int, hidden: torch.Tensor, residual: torch.Tensor | None, point: int | None = None
    ) -> None:
        """A hook (``point``: the capture point a compiled graph's tap carries). An error is kept and raised at the
        step's end, where the TP ranks meet: raised here it would stop this rank's forward while the others wait for
        it in the model's own collectives."""
        if not self._active:
            # Profiling, warm-up, dummy runs and vLLM capturing its CUDA graphs: on the device path the launch is made
            # all the same (disarmed, it writes nothing) so that a graph being captured records it. An error here is
            # the model's shape, the same at every forward: raised now, it stops vLLM's start-up.
            self._check_point(slot, point)  # a compiled graph cached for other settings: refused at start-up
            if hidden.dim() > 2:
                hidden, residual = _rows(hidden), (_rows(residual) if residual is not None else None)
            if self.device_path == "device" and hidden.is_cuda:
                self._launch(slot, hidden, residual)  # checked by the core as it records the launch
            elif slot not in self._shape_checked:  # once a slot: a layer that can never be captured stops start-up
                self.session.check_shape(slot, hidden, residual)
                self._shape_checked.add(slot)
            return
        t = time.perf_counter_ns()
        try:
            self._check_point(slot, point)
            if hidden.dim() > 2:  # [1, tokens, hidden]: vLLM's Transformers modeling backend runs HF's layers
                hidden, residual = _rows(hidden), (_rows(residual) if residual is not None else None)
            hidden, residual = self._unshard(slot, hidden, residual)  # a collective: on every rank, every slot
            if self.sync.failure is None:
                self.capture(slot, hidden, residual)
        except HscaptureError as e:
            self.sync.failed(e)
        except Exception as e:  # noqa: BLE001 - kept typed for the step's end, like the capture's own errors
            self.sync.failed(unexpected(f"the hook of layer id {self.layer_ids[slot]} (slot {slot})", e))
        self.host_ns["hooks"] += time.perf_counter_ns() - t

    def on_traced(self, slot: int, code: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        """A tap of the compiled graph (its Python runs at every forward without CUDA graphs, and when vLLM captures
        them); its capture point is checked against the slot's by the core."""
        if self._active:
            self.traced_taps += 1
        self.on_capture(slot, hidden, residual, code)

    def _check_point(self, slot: int, point: int | None) -> None:
        """A compiled graph's tap carries its capture point: it must be the slot's (the core's codes; the core words
        the refusal)."""
        if point is not None and (slot >= len(self.point_codes) or point != self.point_codes[slot]):
            self.session.check_point(slot, point)

    def _launch(self, slot: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        self.session.capture(slot, hidden, residual, _current_stream(hidden.get_device()))

    def capture(self, slot: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        """One slot's tensors into the session: through the device path (armed first if ``before_forward`` did not
        run), or read on the host."""
        if not self.session.planned:
            self.session.plan(self.step_order())
        if hidden.is_cuda and self.device_path == "device":
            self._launch(slot, hidden, residual)
            return
        if not hidden.is_cpu:
            # Host fallback: only the step's rows travel, synchronously.
            hidden = hidden[: self._total].to("cpu")
            residual = residual[: self._total].to("cpu") if residual is not None else None
        self.session.capture(slot, hidden, residual)

    def end(self) -> None:
        """Ends the step: checks the contract; the steps accounted now are compared across the TP ranks
        (every rank accounts the same steps at the same calls: host steps at their end, device steps at a
        later step's end or begin)."""
        self._active = False

        def account() -> list:
            if self.link is not None and self.session.in_step:
                self.link.exchange(self.step_order)
            self.rpc.check_step(self.session)
            reports = self.session.end_step()
            return reports + self.session.flush() if self.settle_each_step else reports

        self._tell_last_stage()
        try:
            self._meet("ending a step", account)
        except BaseException:
            self._abandon()  # a hook failed, or a check: the step is not committed
            raise

    def abandon(self, exc: BaseException) -> None:
        """The step's forward raised ``exc``: its rows are lost, so the capture stops (a gap would follow).
        The meeting of the step's end is started but not waited for: if the forward failed on this rank
        alone, the others may be waiting in the model's own collectives instead."""
        self._active = False
        self._abandon()
        if not isinstance(exc, Exception):
            return  # the process is going down (KeyboardInterrupt, SystemExit): nothing to record
        if self.sync.failure is None:
            if isinstance(exc, HscaptureError):
                self.sync.raised(exc)  # it is propagating now
            else:
                self.sync.failed(
                    HscaptureError(
                        f"the forward of a step raised {type(exc).__name__}: {exc}; expected it to finish, since that "
                        "step's prompt rows are now lost and its requests would have a gap, so this capture stops (fix "
                        "the cause and re-run: the run resumes)"
                    )
                )
        self._tell_last_stage()
        self.sync.start_failed()

    def _tell_last_stage(self) -> None:
        """An earlier pipeline stage that failed sends its error where its rows were expected."""
        if self.link is None or self.sync.failure is None:
            return
        try:
            self.link.send_failure(self.sync.failure)
        except Exception as e:  # noqa: BLE001 - the failure being reported is the one that matters
            log.error("hscapture: telling the last pipeline stage of this failure: %s", e)

    def _abandon(self) -> None:
        """Drops the step in progress (disarmed on the device); the error being raised is the one that matters, so a
        failure here is logged, not raised over it."""
        if not self.session.in_step:
            return
        try:
            self.session.abandon_step()
        except HscaptureError as e:
            log.error("hscapture: abandoning the step: %s", e)

    def flush(self) -> None:
        """Accounts the device steps still in flight (refused after a failure of any rank)."""
        self._meet("collecting the capture's results", self.session.flush)

    def drain(self) -> list[dict]:
        """Waits until every completed sample is stored (capture continues); returns new records.
        ``drain_seconds`` keeps how long each part took: the steps in flight (copies, checks, assembly,
        handing samples to the writer), then the writes."""
        t0 = time.perf_counter()
        self.flush()
        t1 = time.perf_counter()
        records = list(self._recorded(self.session.drain))
        self.drain_seconds = {"assemble": t1 - t0, "write": time.perf_counter() - t1}
        return records

    def finish(self) -> dict:
        """Flushes and finishes the output; this rank's records and statistics."""
        traced_calls = self.traced_taps if self.traced_points is not None else None
        self._deactivate()  # the compiled graph's taps do nothing from here on
        try:
            self.flush()
        except HscaptureError:
            self.session.finish()  # the writer still writes what it holds and stops; then the error
            self._log_notes()
            raise
        records = list(self._recorded(self.session.finish))
        self._log_notes()
        identity = dict(self.session.identity())
        return {
            "traced_calls": traced_calls,
            "tp_rank": self.tp.rank,
            "writer": self.writer_rank,
            "records": records,
            "aborted": [list(a) for a in self.session.take_aborted()],
            "skipped": [{"sample": k, "request_id": r, "why": why} for k, r, why in self.session.take_skipped()],
            "stats": dict(self.session.stats()),
            "device_path": self.device_path,
            **identity,  # the core's: layer_ids, convention, dtype as stored, hidden_size, num_hidden_layers, ...
            "model_dtype": self.model_dtype,
            "tp_size": self.tp.size,
        }

    def close(self, meet: bool = True) -> None:
        """Accounts the steps still in flight, then releases the hooks and the session. Every rank flushes,
        failed or not (the ranks meet there); a failure is logged, and recorded for the driver when it is
        this rank's own, never raised: ranks that raised here on some ranks only would part (a reload builds
        a new capture on each, which meet at start-up). ``meet=False``: the steps in flight are dropped unaccounted
        (no meeting: the other ranks may be gone); what was agreed is still written."""
        try:
            if meet:
                self.flush()
        except HscaptureError as e:
            log.error("hscapture: closing the capture: %s", e)
        finally:
            inproc.unregister(self)
            for h in self.handles:
                h.remove()
            self.handles = []
            if self.order is not None:
                self.order.close()
            self._deactivate()
            for part in ([self.link.close] if self.link is not None else []) + [self.session.finish]:
                try:
                    part()
                except HscaptureError as e:  # the writer's error again, say: recorded, logged, not raised
                    self.sync.failed(e)
                    log.error("hscapture: closing the capture: %s", e)
            self._log_notes()

    def shutdown(self) -> None:
        """vLLM stops this worker (SIGTERM, the engine's shutdown): the samples already agreed on are written before
        it exits, and every request still waiting for its file fails (its lock is given up: its client finds no
        file, never a wait). The steps in flight are accounted at TP=1 only: with more ranks the others may be gone,
        and a meeting with them could wait past vLLM's kill."""
        log.info("hscapture: the worker is shutting down: writing the agreed samples, failing the rest")
        self.close(meet=self.tp.size == 1)

    def _deactivate(self) -> None:
        if self.traced_active:
            from . import traced

            traced.deactivate()
            self.traced_active = False


def run_step(worker: Any, call: Callable[..., Any], scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
    """``call(scheduler_output, ...)`` (the base ``execute_model``) bracketed by the worker's capture.
    Shared by ``CaptureWorker`` (a class override) and the speculators-compatible extension (which can
    only wrap the worker instance's method)."""
    vllm_compat.complete_pending_sample(worker)
    cap = getattr(worker, "_hscapture", None)
    if cap is None or getattr(worker, "_hscapture_paused", False):
        return call(scheduler_output, *args, **kwargs)
    mark = cap.times.mark()
    t0 = time.perf_counter_ns()
    cap.begin(scheduler_output)
    t1 = time.perf_counter_ns()
    try:
        out = call(scheduler_output, *args, **kwargs)
    except BaseException as e:
        cap.abandon(e)
        raise
    t2 = time.perf_counter_ns()
    cap.end()
    cap.times.step(mark, t1 - t0, time.perf_counter_ns() - t2)
    return out
