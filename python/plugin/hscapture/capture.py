"""Capture on one worker: owns the Rust ``CaptureSession``, the hooks, and the per-step protocol.

Per step (``execute_model``): ``begin`` with the scheduler output; the first hook of the forward
reads the order the runner laid the step out in and fixes the plan; each hook captures its slot;
``end`` checks the contract, compares the step checksum across the tensor-parallel group and hands
completed samples to the writer (on the writing rank).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from . import _native, hooks, meeting, vllm_compat
from .config import CaptureConfig
from .errors import AttributionError, CompatibilityError, ConfigError, HscaptureError, ShapeContractError
from .failures import record_failure

log = logging.getLogger("hscapture")


def _model_facts(vllm_config: Any) -> tuple[int, int, torch.dtype, str]:
    mc = vllm_config.model_config
    text = getattr(mc, "hf_text_config", None) or mc.hf_config
    return int(text.num_hidden_layers), int(mc.get_hidden_size()), mc.dtype, str(mc.model)


def _split_layers(d: dict) -> list[torch.Tensor]:
    """A sample from ``take_samples`` as one ``[L, H]`` tensor per layer."""
    t = torch.frombuffer(bytearray(d["data"]), dtype=getattr(torch, d["dtype"])).reshape(d["shape"])
    return [t[:, k, :].clone() for k in range(t.shape[1])]


def _assembly_ring() -> int:
    """Step buffers for background assembly (``HSCAPTURE_ASSEMBLY``, ``HSCAPTURE_HOST_RING``); 0 = inline."""
    from . import envs

    mode = envs.get("HSCAPTURE_ASSEMBLY")
    if mode not in ("background", "inline"):
        raise ConfigError(f"HSCAPTURE_ASSEMBLY={mode!r} is not valid: expected `background` or `inline`")
    if mode == "inline":
        return 0
    ring = envs.get("HSCAPTURE_HOST_RING")
    if ring < 2:
        raise ConfigError(f"HSCAPTURE_HOST_RING={ring} is not valid: background assembly needs at least 2 step buffers; "
                          "set HSCAPTURE_ASSEMBLY=inline to assemble on the worker's thread")
    return ring


class WorkerCapture:
    def __init__(self, worker: Any, cfg: CaptureConfig) -> None:
        vc = worker.vllm_config
        compiled = vllm_compat.compiled(vc)
        pp_size, pp_rank = vllm_compat.pp_info()
        n_layers, hidden, model_dtype, model = _model_facts(vc)
        layer_ids = cfg.resolve(n_layers)
        tp = vllm_compat.TPGroup()
        writer = tp.rank == 0 and pp_rank == pp_size - 1  # the last stage assembles (pipeline.py)
        model_dtype = str(model_dtype).removeprefix("torch.")
        out_dtype = model_dtype if cfg.dtype == "auto" else cfg.dtype
        meta = {"format": "hscapture/1", "convention": cfg.convention, "layer_ids": ",".join(map(str, layer_ids)),
                "model": cfg.model_name or model}
        session = _native.CaptureSession(
            layer_ids, cfg.convention, n_layers, hidden, model_dtype, out_dtype,
            assemble=writer, out_dir=cfg.out if writer else None,
            writer_threads=cfg.writer_threads, writer_queue=cfg.writer_queue, durable=cfg.durable, metadata=meta,
            compress=cfg.compress or None,
        )
        session.set_skip_nonfinite(cfg.on_nonfinite == "skip")
        ring = _assembly_ring()
        if writer and ring:
            session.set_background(ring)
        self._init_state(cfg, session, tp, worker.model_runner, int(getattr(worker, "rank", 0)), writer)
        self.num_hidden_layers, self.hidden_size, self.out_dtype = n_layers, hidden, out_dtype
        name, layers = hooks.find_decoder_layers(worker.get_model(), n_layers)
        points = self.capture_points()
        local = [slot for slot, (_kind, k) in enumerate(points) if not hooks.is_missing(layers[k])]
        if pp_size > 1:
            from .pipeline import StageLink

            self.link = StageLink(session, pp_size, pp_rank, tp.rank, local, len(points))
        failure: HscaptureError | None = None
        try:
            self.device_path = "host" if pp_size > 1 and torch.cuda.is_available() else self._enable_device(vc)
        except HscaptureError as e:  # reported after the ranks compared paths, so that none waits for this one
            self.device_path, failure = "failed", e
        self._agree_on_path(failure)
        self._install_hooks(vc, layers, points, compiled)
        log.info("hscapture: capturing %s ids %s at %s (%d hooks%s), tp rank %d/%d, pp rank %d/%d, writer=%s",
                 cfg.convention, self.layer_ids, name, len(self.handles), ", traced into torch.compile" if compiled else "",
                 self.tp.rank, self.tp.size, pp_rank, pp_size, self.writer_rank)

    def _install_hooks(self, vc: Any, layers: Any, points: list, compiled: bool) -> None:
        """Eager: the hooks call this capture. Compiled: they call hscapture's ops (traced.py), each tap
        carrying its slot's capture point so that a graph built for other points (vLLM's compile cache)
        is refused instead of filing one layer's states under another's id. On failure nothing stays
        installed or active."""
        try:
            on_capture, on_positions = self._on_capture, self._on_positions
            if compiled:
                from . import traced

                traced.ensure_ops()
                codes = tuple(traced.point_code(kind, k) for kind, k in points)
                self._point_codes = codes
                if isinstance(getattr(vc, "additional_config", None), dict):
                    # vLLM keys its compile cache on a hash of the config; settings given by environment
                    # variables alone would not be in it
                    vc.additional_config["hscapture_traced_points"] = list(codes)
                on_capture = lambda slot, h, r, codes=codes: traced.tap(h, r, slot, codes[slot])  # noqa: E731
                on_positions = traced.positions
            self.handles = hooks.install(layers, points, on_capture)
            if self.tp.size > 1:  # a sharded residual stream exists only across TP ranks
                self.handles += hooks.install_positions_probe(layers, on_positions)
            if compiled:
                traced.activate(self._on_traced, self._on_positions)
                self._traced = True
        except BaseException:
            for h in self.handles:
                h.remove()
            self.handles = []
            self.session.finish()
            raise

    def _on_traced(self, slot: int, code: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        """A tap of the compiled graph: its capture point must be the one this slot was configured with."""
        if slot >= len(self._point_codes) or code != self._point_codes[slot]:
            from . import traced

            e = CompatibilityError(
                f"the compiled graph taps {traced.describe(code)} for slot {slot}, but this capture reads "
                f"{traced.describe(self._point_codes[slot]) if slot < len(self._point_codes) else 'no such slot'} "
                f"there (layer ids {self.layer_ids}, {self.cfg.convention} convention): vLLM loaded a torch.compile "
                "artifact cached by a run with other capture settings; set VLLM_DISABLE_COMPILE_CACHE=1, or give the "
                "settings in additional_config"
            )
            self._failed(e)  # raised at the step's end (see _on_capture); the driver re-raises it by type
        elif self._active:
            self._traced_taps += 1
        self._on_capture(slot, hidden, residual)  # after a failure: only its collectives, no capture

    def _enable_device(self, vc: Any) -> str:
        """The capture path for CUDA tensors: ``device`` (kernel + arena + async copies), ``host`` (copies
        in the hook; slow, correct) or ``none`` (the model is not on CUDA)."""
        from . import envs

        if not torch.cuda.is_available() or getattr(vc.device_config, "device_type", "cuda") != "cuda":
            return "none"
        mode = envs.get("HSCAPTURE_DEVICE_PATH")
        if mode == "off":
            return "host"
        from .cuda_libs import preload_nvrtc

        preload_nvrtc()
        rows = int(vc.scheduler_config.max_num_batched_tokens)
        overlap = self._overlap = bool(envs.get("HSCAPTURE_DEVICE_OVERLAP"))
        try:
            # The assembler's ring (ranks that only verify need one buffer), plus the step in flight.
            ring = ((_assembly_ring() if self.session.background else 0) or 1) + int(overlap)
            arch = self.session.enable_device(torch.cuda.current_device(), rows, ring, overlap)
        except HscaptureError as e:
            if mode == "required":
                raise
            log.warning("hscapture: the CUDA capture path is unavailable (%s); copying to the host in the hook", e)
            return "host"
        log.info("hscapture: CUDA capture kernel built for %s; device arena %.1f MiB for %d rows; %d pinned host "
                 "buffer(s), assembly %s, steps %s", arch, self.session.device_bytes / 2**20, rows, ring,
                 "on the assembler thread" if self.session.background else "inline",
                 "overlapped" if overlap else "collected when the next begins")
        return "device"

    _PATHS = ("none", "host", "device", "failed")

    def _agree_on_path(self, failure: HscaptureError | None = None) -> None:
        """Every TP rank must capture the same way: device steps are accounted later than host steps
        (and later still with overlap), so ranks on different paths would compare the checksums of
        different steps, or wait for each other forever at the end. Refused at start-up, naming ranks.
        A rank whose set-up failed (``failure``) still takes part, so that no rank waits for it."""
        if self.tp.size <= 1:
            if failure is not None:
                raise failure
            return
        overlap = self.device_path == "device" and bool(self._overlap)
        mine = self._PATHS.index(self.device_path) * 2 + int(overlap)
        codes = self.tp.all_gather_i64(mine)
        failed = [r for r, c in enumerate(codes) if self._PATHS[c // 2] == "failed"]
        if failure is not None:
            raise failure
        if failed:
            e = CompatibilityError(
                f"tensor-parallel rank(s) {failed} could not set up their capture path (their logs say why); "
                "expected every rank to start, so this rank stops too"
            )
            e.hscapture_peer = True  # record_failure leaves it out: the failed rank's own error is the cause
            raise e
        if len(set(codes)) == 1:
            return
        seen = [f"rank {r}: {self._PATHS[c // 2]}{' (overlapped steps)' if c % 2 else ''}" for r, c in enumerate(codes)]
        raise CompatibilityError(
            f"the tensor-parallel ranks capture in different ways ({'; '.join(seen)}); expected the same path on "
            "every rank, since each path accounts steps at different calls and the cross-rank check would compare "
            "different steps. A rank that fell back to host copies logged why (its CUDA capture path is unavailable); "
            "fix that, or set HSCAPTURE_DEVICE_PATH=off (and the same HSCAPTURE_DEVICE_OVERLAP) for every rank"
        )

    def _init_state(self, cfg: CaptureConfig, session: Any, tp: Any, model_runner: Any, global_rank: int,
                    writer: bool | None = None) -> None:
        """Everything but vLLM: the parts tests assemble without an engine."""
        self.cfg = cfg
        self.session = session
        self.layer_ids = list(session.layer_ids)
        self.tp = tp
        self.writer_rank = tp.rank == 0 if writer is None else writer
        self.link: Any = None
        self.drain_seconds: dict[str, float] = {}
        self._overlap = False
        self.model_runner = model_runner
        self.order = vllm_compat.RunnerOrder(model_runner) if model_runner is not None else None
        self._scheduled: dict[str, int] = {}
        self.global_rank = global_rank
        self.handles: list[Any] = []
        self._traced = False  # the hooks call hscapture's ops inside vLLM's compiled graph (traced.py)
        self._point_codes: tuple[int, ...] = ()
        self._traced_taps = 0  # taps of the compiled graph during captured steps
        self.device_path = "none"
        self._active = False
        self._failure: HscaptureError | None = None  # the first error of this capture (it refuses all after)
        self._stopped_by: list[str] | None = None  # the TP ranks whose failure stopped this one
        self._failure_raised = False  # whether the first failure was raised once already (as itself)
        self._pending_meeting: Any = None  # a meeting started by `abandon`, waited for by the next one
        self._total = 0
        self._forward_tokens = 0
        # The RPC surface (speculators' drivers): the driver's per-step view, admission order, answer shape.
        self._expected: dict[str, int] | None = None
        self._metadata_seen = False
        self._admitted: list[str] = []
        self._admitted_set: set[str] = set()

    # -- what to read, and in which order (the two facts attribution rests on) ----------------
    def capture_points(self) -> list[tuple[str, int]]:
        """Where each layer slot is read: ``("embeddings", 0)`` or ``("layer_output", k)``."""
        return self.session.capture_points()

    def step_order(self) -> list[str]:
        """Request ids in the order the model runner laid out the step being executed."""
        return self.order.order(self._scheduled)

    # -- the step protocol -------------------------------------------------------------------
    def _failed(self, e: HscaptureError) -> None:
        """Leaves the typed error where the driver finds it (vLLM reports only that the engine died), and
        keeps the first one: from now on this capture refuses every step and every result."""
        if self._failure is None:
            self._failure, self._failure_raised = e, False  # raised as itself at the next meeting, then refused
        record_failure(self.cfg.out, self.global_rank, e)

    def _refuse(self, what: str) -> None:
        """After a failure nothing goes on: vLLM may keep scheduling steps after a worker raised (0.23's
        batch queue went on for four more steps), and a driver must never get a successful result from a
        run that lost a step."""
        if self._stopped_by is not None:
            raise self._peer_error(f"{what} refused: {', '.join(self._stopped_by)} failed at an earlier step")
        e = self._failure
        raise type(e)(
            f"{what} refused: this rank (rank {self.global_rank}) failed earlier, so the capture has a gap; "
            f"expected no failure, found: {e}. Fix that and re-run: complete samples already on disk are kept and "
            "the re-run resumes after them"
        ) from e

    def _stopped_by_peers(self, what: str, peers: list[str]) -> None:
        """Other TP ranks failed: this one stops too (not recorded: their own error is the root cause)."""
        self._stopped_by, self._failure_raised = peers, True
        self._failure = self._peer_error(f"{what} refused: {', '.join(peers)} failed")
        raise self._failure

    @staticmethod
    def _peer_error(said: str) -> HscaptureError:
        e = HscaptureError(
            f"{said} (the driver reports their own error; their logs have it); expected every rank to be "
            "capturing, so this rank stops with them"
        )
        e.hscapture_peer = True  # record_failure leaves it out
        return e

    def begin(self, scheduler_output: Any) -> None:
        try:  # device steps still in flight beyond the one overlap keeps are accounted here
            meeting.meet(self, "a new step", lambda: self.session.begin_step(*vllm_compat.step_args(scheduler_output)))
        except HscaptureError:
            if self.session.in_step:
                self.session.abandon_step()  # this step will not run; the next one must not find it begun
            raise
        self._total = int(scheduler_output.total_num_scheduled_tokens)
        self._forward_tokens = 0
        self._scheduled = dict(scheduler_output.num_scheduled_tokens)
        if self.order is not None:
            self.order.reset()
        self._active = True
        for r in scheduler_output.scheduled_new_reqs:
            if r.req_id not in self._admitted_set:
                self._admitted_set.add(r.req_id)
                self._admitted.append(r.req_id)

    def _on_positions(self, positions: torch.Tensor) -> None:
        if self._active:
            self._forward_tokens = int(positions.shape[-1])

    def _unshard(self, slot: int, hidden: torch.Tensor, residual: torch.Tensor | None):
        """A residual stream sharded across the TP ranks (sequence-parallel MoE) is gathered, in rank
        order, before capture; a shape that is neither replicated nor that sharding is refused."""
        if hidden.shape[0] >= self._total:
            return hidden, residual
        where = f"layer id {self.layer_ids[slot]} ({self.cfg.convention} convention, slot {slot})"
        chunk = _native.row_layout(int(hidden.shape[0]), self._forward_tokens or self._total, self._total,
                                   self.tp.size, self.tp.rank, where)
        if chunk is None:
            return hidden, residual
        return self.tp.gather_rows(hidden), (self.tp.gather_rows(residual) if residual is not None else None)

    def _on_capture(self, slot: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        """A hook. An error is kept and raised at the step's end, where the TP ranks meet: raised here it
        would stop this rank's forward while the others wait for it in the model's own collectives."""
        if not self._active:
            return  # profiling, warm-up and dummy runs
        try:
            hidden, residual = self._unshard(slot, hidden, residual)  # a collective: on every rank, every slot
            if self._failure is None:
                self._capture(slot, hidden, residual)
        except HscaptureError as e:
            self._failed(e)
        except Exception as e:  # noqa: BLE001 - kept typed for the step's end, like the capture's own errors
            self._failed(meeting.unexpected(f"the hook of layer id {self.layer_ids[slot]} (slot {slot})", e))

    def _capture(self, slot: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        if not self.session.planned:
            self.session.plan(self.step_order())
        if hidden.device.type == "cuda" and self.device_path == "device":
            self.session.capture(slot, hidden, residual, torch.cuda.current_stream(hidden.device).cuda_stream)
            return
        if hidden.device.type != "cpu":
            # Host fallback: only the step's rows travel, synchronously.
            hidden = hidden[: self._total].to("cpu")
            residual = residual[: self._total].to("cpu") if residual is not None else None
        self.session.capture(slot, hidden, residual)

    def end(self) -> None:
        """Ends the step: checks the contract; the steps accounted now are compared across the TP ranks
        (``meeting.py``: every rank accounts the same steps at the same calls, host steps at their end,
        device steps at a later step's end or begin)."""
        self._active = False

        def account() -> list:
            if self.link is not None and self.session.in_step:
                self.link.exchange(self.step_order)
            self._check_expected()
            return self.session.end_step()

        try:
            meeting.meet(self, "ending a step", account)
        except BaseException:
            if self.session.in_step:
                self.session.abandon_step()  # a hook failed, or a check: the step is not committed
            raise

    def flush(self) -> None:
        """Assembles the device steps still in flight (refused after a failure of any rank)."""
        meeting.meet(self, "collecting the capture's results", self.session.flush)

    def _check_expected(self) -> None:
        expected, self._expected = self._expected, None
        if expected is None:
            return
        ours = dict(self.session.step_rows())
        theirs = {str(k): int(v) for k, v in expected.items() if int(v) > 0}
        if ours != theirs:
            diff = sorted(set(ours) | set(theirs))
            lines = [f"{r}: hscapture {ours.get(r, 0)}, driver {theirs.get(r, 0)}" for r in diff if ours.get(r, 0) != theirs.get(r, 0)]
            if self.session.in_step:
                self.session.abandon_step()
            raise AttributionError(
                "the driver's request metadata disagrees with the scheduler output about which prompt tokens this step "
                f"holds ({'; '.join(lines[:8])}); the driver's own bookkeeping has drifted (preemption? chunked prefill?) "
                "— hscapture attributes by the scheduler output, which is what the model ran"
            )

    # -- the RPC surface (speculators' offline generator) --------------------------------------
    def expect_rows(self, metadata: dict) -> None:
        self._expected = dict(metadata)
        self._metadata_seen = True

    def reset(self) -> None:
        self.session.take_samples()
        self.session.take_aborted()
        self._expected, self._metadata_seen = None, False
        self._admitted, self._admitted_set = [], set()

    def store(self, aux_hidden_states: list) -> None:
        if not self._active:
            raise AttributionError("_store_captured_states was called outside a step; states belong to the step that computed them")
        if len(aux_hidden_states) != len(self.layer_ids):
            raise ShapeContractError(
                f"_store_captured_states: expected {len(self.layer_ids)} tensors (layers {self.layer_ids}), found {len(aux_hidden_states)}"
            )
        for slot, t in enumerate(aux_hidden_states):
            self._capture(slot, t, None)

    def collect(self):
        self.flush()
        if not self.writer_rank:
            return None
        samples = {d["request_id"]: d for d in self.session.take_samples()}
        if not samples:
            return None
        layers = {rid: _split_layers(d) for rid, d in samples.items()}
        if self._metadata_seen:
            return layers
        missing = [r for r in self._admitted if r not in layers]
        if missing:
            raise AttributionError(
                f"{len(missing)} admitted requests have no complete states (first: {missing[:5]}): the driver finished "
                "them before their prefill was done (a request split across steps by chunked prefill and aborted after "
                "its first chunk?); raise max_num_batched_tokens above the longest prompt"
            )
        order = [r for r in self._admitted if r in layers]
        return [torch.cat([layers[r][k] for r in order], dim=0) for k in range(len(self.layer_ids))]

    def close(self) -> None:
        """Assembles the steps still in flight (with overlapped device steps there is one), then releases
        the hooks and the session. Every rank flushes, failed or not (the ranks meet there); a failure is
        logged, and recorded for the driver when it is this rank's own, never raised: ranks that raised
        here on some ranks only would part (a reload builds a new capture on each, which meet at start-up)."""
        try:
            self.flush()  # on every rank, failed or not: the ranks meet there
        except HscaptureError as e:
            # Never raised here, so that every rank goes on alike (a reload builds a new capture on each):
            # the failure was raised by the call where it happened, or is recorded for the driver now.
            log.error("hscapture: closing the capture: %s", e)
        finally:
            for h in self.handles:
                h.remove()
            self.handles = []
            self._deactivate()
            for part in ([self.link.close] if self.link is not None else []) + [self.session.finish]:
                try:
                    part()
                except HscaptureError as e:  # the writer's error again, say: recorded, logged, not raised
                    self._failed(e)
                    log.error("hscapture: closing the capture: %s", e)

    def _deactivate(self) -> None:
        if self._traced:
            from . import traced

            traced.deactivate()
            self._traced = False

    def abandon(self, exc: BaseException) -> None:
        """The step's forward raised ``exc``: its rows are lost, so the capture stops (a gap would follow).
        The meeting of the step's end is started here but not waited for: if the forward failed on this
        rank alone, the others may be waiting in the model's own collectives instead."""
        self._active = False
        if self.session.in_step:
            self.session.abandon_step()
        if not isinstance(exc, Exception):
            return
        if self._failure is None:
            if isinstance(exc, HscaptureError):
                self._failed(exc)
                self._failure_raised = True  # it is propagating now
            else:
                self._failed(HscaptureError(
                    f"the forward of a step raised {type(exc).__name__}: {exc}; expected it to finish, since that "
                    "step's prompt rows are now lost and its requests would have a gap, so this capture stops (fix "
                    "the cause and re-run: the run resumes)"))
        # The others may be in this step's end, meeting: this rank says it failed without waiting for
        # them (they may instead wait in the model's collectives); its next meeting waits for this one.
        meeting.start(self)

    def _recorded(self, call: Any) -> Any:
        """``call()``; its error is this capture's failure (recorded for the driver, refused after)."""
        try:
            return call()
        except HscaptureError as e:
            self._failed(e)
            raise

    def drain(self) -> list[dict]:
        """Waits until every completed sample is on disk (capture continues); returns new records.
        ``drain_seconds`` keeps how long each part took: the steps in flight (copies, checks, assembly,
        handing samples to the writer), then the writes."""
        t0 = time.perf_counter()
        self.flush()
        t1 = time.perf_counter()
        records = list(self._recorded(self.session.drain))
        self.drain_seconds = {"assemble": t1 - t0, "write": time.perf_counter() - t1}
        return records

    def finish(self) -> dict:
        traced_calls = self._traced_taps if self._traced else None
        self._deactivate()  # the compiled graph's taps do nothing from here on
        try:
            self.flush()
        except HscaptureError:
            self.session.finish()  # the writer still writes what it holds and stops; then the error
            raise
        records = list(self._recorded(self.session.finish))
        return {
            "traced_calls": traced_calls,
            "tp_rank": self.tp.rank,
            "writer": self.writer_rank,
            "records": records,
            "aborted": [list(a) for a in self.session.take_aborted()],
            "skipped": [{"sample": k, "request_id": r, "why": why} for k, r, why in self.session.take_skipped()],
            "stats": dict(self.session.stats()),
            "device_path": self.device_path,
            "layer_ids": list(self.layer_ids),
            "convention": self.cfg.convention,
            "dtype": self.out_dtype,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "tp_size": self.tp.size,
        }
