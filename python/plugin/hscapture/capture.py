"""Capture on one worker: owns the Rust ``CaptureSession``, the hooks, and the per-step protocol.

Per step (``execute_model``): ``begin`` with the scheduler output; the first hook of the forward
reads the order the runner laid the step out in and fixes the plan; each hook captures its slot;
``end`` checks the contract, compares the step checksum across the tensor-parallel group and hands
completed samples to the writer (on the writing rank).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from . import _native, hooks, vllm_compat
from .config import CaptureConfig
from .errors import CompatibilityError, HscaptureError
from .failures import record_failure

log = logging.getLogger("hscapture")


def _model_facts(vllm_config: Any) -> tuple[int, int, torch.dtype, str]:
    mc = vllm_config.model_config
    text = getattr(mc, "hf_text_config", None) or mc.hf_config
    return int(text.num_hidden_layers), int(mc.get_hidden_size()), mc.dtype, str(mc.model)


class WorkerCapture:
    def __init__(self, worker: Any, cfg: CaptureConfig) -> None:
        vc = worker.vllm_config
        vllm_compat.check_eager(vc)
        vllm_compat.check_runner(worker.model_runner)
        pp_size, _ = vllm_compat.pp_info()
        if pp_size > 1:
            raise CompatibilityError(
                f"pipeline parallelism (pipeline_parallel_size={pp_size}) is not supported yet: layers on other stages "
                "would not be captured; run with pipeline_parallel_size=1"
            )
        n_layers, hidden, model_dtype, model = _model_facts(vc)
        self.cfg = cfg
        self.layer_ids = cfg.resolve(n_layers)
        self.num_hidden_layers, self.hidden_size = n_layers, hidden
        self.tp = vllm_compat.TPGroup()
        self.writer_rank = self.tp.rank == 0
        self.model_dtype = str(model_dtype).removeprefix("torch.")
        self.out_dtype = self.model_dtype if cfg.dtype == "auto" else cfg.dtype
        self.model_runner = worker.model_runner
        self.global_rank = int(getattr(worker, "rank", 0))
        meta = {
            "format": "hscapture/1",
            "convention": cfg.convention,
            "layer_ids": ",".join(map(str, self.layer_ids)),
            "model": cfg.model_name or model,
        }
        self.session = _native.CaptureSession(
            self.layer_ids, cfg.convention, n_layers, hidden, self.model_dtype, self.out_dtype,
            assemble=self.writer_rank, out_dir=cfg.out if self.writer_rank else None,
            writer_threads=cfg.writer_threads, writer_queue=cfg.writer_queue, durable=cfg.durable, metadata=meta,
        )
        name, layers = hooks.find_decoder_layers(worker.get_model(), n_layers)
        self.handles = hooks.install(layers, self.capture_points(), self._on_capture)
        self._active = False
        self._total = 0
        log.info("hscapture: capturing %s ids %s at %s (%d hooks), tp rank %d/%d, writer=%s",
                 cfg.convention, self.layer_ids, name, len(self.handles), self.tp.rank, self.tp.size, self.writer_rank)

    # -- what to read, and in which order (the two facts attribution rests on) ----------------
    def capture_points(self) -> list[tuple[str, int]]:
        """Where each layer slot is read: ``("embeddings", 0)`` or ``("layer_output", k)``."""
        return self.session.capture_points()

    def step_order(self) -> list[str]:
        """Request ids in the order the model runner laid out the step being executed."""
        return vllm_compat.runner_order(self.model_runner)

    # -- the step protocol -------------------------------------------------------------------
    def _failed(self, e: HscaptureError) -> None:
        """Leaves the typed error where the driver finds it (vLLM reports only that the engine died)."""
        self._active = False
        record_failure(self.cfg.out, self.global_rank, e)

    def begin(self, scheduler_output: Any) -> None:
        try:
            self.session.begin_step(*vllm_compat.step_args(scheduler_output))
        except HscaptureError as e:
            self._failed(e)
            raise
        self._total = int(scheduler_output.total_num_scheduled_tokens)
        self._active = True

    def _on_capture(self, slot: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        if not self._active:
            return  # profiling, warm-up and dummy runs
        try:
            self._capture(slot, hidden, residual)
        except HscaptureError as e:
            self._failed(e)
            raise

    def _capture(self, slot: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        if not self.session.planned:
            self.session.plan(self.step_order())
        if hidden.device.type != "cpu":
            # Host fallback until the device path exists: only the step's rows travel.
            hidden = hidden[: self._total].to("cpu")
            residual = residual[: self._total].to("cpu") if residual is not None else None
        self.session.capture(slot, hidden, residual)

    def end(self) -> None:
        self._active = False
        try:
            step, checksum, rows, _completed = self.session.end_step()
            if self.tp.size > 1 and self._total > 0:
                self.session.verify_ranks(step, "tensor-parallel", self.tp.all_gather_i64(checksum))
        except HscaptureError as e:
            self._failed(e)
            raise

    def abandon(self) -> None:
        self._active = False
        if self.session.in_step:
            self.session.abandon_step()

    def finish(self) -> dict:
        records = list(self.session.finish())
        return {
            "tp_rank": self.tp.rank,
            "writer": self.writer_rank,
            "records": records,
            "aborted": [list(a) for a in self.session.take_aborted()],
            "stats": dict(self.session.stats()),
            "layer_ids": list(self.layer_ids),
            "convention": self.cfg.convention,
            "dtype": self.out_dtype,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "tp_size": self.tp.size,
        }
