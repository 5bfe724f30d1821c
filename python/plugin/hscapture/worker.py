"""``CaptureWorker``: vLLM's worker for this platform, plus hidden-state capture.

Load it with ``--worker-cls hscapture.worker.CaptureWorker`` or ``LLM(worker_cls=...)``. It
subclasses the worker the platform would have used (``CPUWorker`` on CPU, the GPU ``Worker`` on
CUDA) and overrides only ``load_model`` (install hooks), ``execute_model`` (bracket each step) and ``shutdown``
(write what was agreed);
``sample_tokens`` and everything else are the base class's. It also carries the speculators-compatible
RPC surface (``hscapture.rpc.HiddenStatesRPC``).
"""

from __future__ import annotations

import logging
from typing import Any

from .adapters import vllm_compat
from .adapters.requested import capture_config
from .capture.worker_capture import WorkerCapture, run_step
from .errors import HscaptureError
from .output.failures import record_failure
from .rpc import HiddenStatesRPC

log = logging.getLogger("hscapture")

_Base: type = vllm_compat.resolve_qualname(vllm_compat.platform_worker_qualname())


class CaptureWorker(HiddenStatesRPC, _Base):  # type: ignore[misc, valid-type]
    capture_cls: type[WorkerCapture] = WorkerCapture
    _hscapture_brackets_steps = True
    _hscapture: WorkerCapture | None = None
    _hscapture_paused = False
    _hscapture_shims_checked = False

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        additional = getattr(self.vllm_config, "additional_config", None)
        try:
            cfg = capture_config(self.vllm_config)
            if cfg is not None:
                if self._hscapture is not None:  # the model was loaded again: the old hooks go with the old model
                    self._hscapture.close()
                    self._hscapture = None
                self._hscapture = self.capture_cls.from_worker(self, cfg)
        except HscaptureError as e:
            section = (additional or {}).get("hscapture") if isinstance(additional, dict) else None
            record_failure((section or {}).get("out"), int(getattr(self, "rank", 0)), e)
            raise

    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
        """Warm-up forwards are not data: Model Runner V2 warms up with real-looking requests
        (``_warmup_{i}_``) through ``execute_model``; nothing is captured until it is done."""
        self._hscapture_paused = True
        try:
            return super().compile_or_warm_up_model(*args, **kwargs)
        finally:
            self._hscapture_paused = False

    def shutdown(self) -> None:
        """vLLM calls this when it stops the worker (on SIGTERM too): queued samples are written, or their requests
        failed, before the process exits (``WorkerCapture.shutdown``)."""
        cap, self._hscapture = self._hscapture, None
        if cap is not None:
            try:
                cap.shutdown()
            except Exception as e:  # noqa: BLE001 - vLLM's own shutdown must still run
                log.error("hscapture: shutting the capture down: %s", e)
        base = getattr(super(), "shutdown", None)
        if base is not None:
            base()

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any):
        if not self._hscapture_shims_checked:  # after warm-up: what it left undone is now visible
            from .patches import apply_worker_shims

            self._hscapture_shims_checked = True
            apply_worker_shims(self)
        return run_step(self, super().execute_model, scheduler_output, *args, **kwargs)

    # -- RPC (collective_rpc("hscapture_drain" | "hscapture_finish")) ---------------------------
    def hscapture_drain(self) -> dict | None:
        """Waits until every completed sample is written, capture continuing; this rank's new records."""
        cap = self._hscapture
        if cap is None:
            return None
        records = cap.drain()
        return {
            "tp_rank": cap.tp.rank,
            "writer": cap.writer_rank,
            "records": records,
            "device_path": cap.device_path,
            "seconds": cap.drain_seconds,
        }

    def hscapture_stats(self) -> dict:
        """This rank's resident memory and capture totals (for soaks, dashboards and benchmarks): the session's counts,
        the nanoseconds its calls took in the core (``ns_*``) and each part of the step took on this worker's thread,
        Python included (``host_ns_*``), and per part the steps in which it took over 1 ms (``host_slow_*``: [steps,
        ns])."""
        import psutil

        out = {"rss": psutil.Process().memory_info().rss}
        if self._hscapture is not None:
            out.update(dict(self._hscapture.session.stats()))
            out.update(self._hscapture.times.stats())
        return out

    def hscapture_finish(self) -> dict | None:
        """Flushes the writer; returns this rank's records and statistics (None if not capturing)."""
        return self._hscapture.finish() if self._hscapture is not None else None


__all__ = ["CaptureWorker"]
