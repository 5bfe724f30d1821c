"""The RPC surface of speculators' offline generator, on hscapture's capture.

``HiddenStatesRPC`` works two ways:
- as a worker extension (``worker_extension_cls="hscapture.rpc.HiddenStatesRPC"``, or swapped in for
  ``speculators.data_generation.custom_worker.HiddenStatesWorkerExtension`` by the plugin when
  ``HSCAPTURE_SPECULATORS=1``): vLLM appends it to the worker's bases, so it can only add methods; it
  brackets steps by wrapping the worker instance's ``execute_model``;
- mixed into ``CaptureWorker``, whose ``execute_model`` already brackets steps.

Layer ids are in the ``after`` convention, as speculators 0.3/0.4 use them. ``_get_captured_states``
answers in the shape the calling driver expects: speculators 0.4 sends ``_set_request_metadata``
before each step and gets ``{req_id: [per-layer [L, H]]}``; 0.3 never does and gets one tensor per
layer with every request's prompt tokens concatenated, requests in the order the scheduler admitted
them (the order 0.3's driver slices them back in). hscapture's own attribution must agree with the
metadata the driver sends; a disagreement is an ``AttributionError``.
"""

from __future__ import annotations

from typing import Any

from .adapters import vllm_compat
from .capture.worker_capture import WorkerCapture, run_step
from .config import CaptureConfig
from .errors import AttributionError, CompatibilityError, ConfigError

_HOW = "call _setup_hidden_states_capture(layer_ids) first"


class HiddenStatesRPC:
    def _hscapture_session(self, what: str):
        cap = getattr(self, "_hscapture", None)
        if cap is None:
            raise ConfigError(f"{what}: hidden-state capture is not set up on this worker; {_HOW}")
        return cap

    def _setup_hidden_states_capture(self, layer_ids: list[int]) -> None:
        """Captures ``layer_ids`` (``after`` convention) from now on, keeping samples in memory."""
        if not isinstance(layer_ids, (list, tuple)):
            raise ConfigError(
                f"_setup_hidden_states_capture: expected a list of layer ids, found {type(layer_ids).__name__}"
            )
        ex = vllm_compat.execution(getattr(self, "vllm_config", None))
        if ex.compiled or ex.graphs:
            raise CompatibilityError(
                f"_setup_hidden_states_capture: vLLM compiled the model or captured its CUDA graphs ({ex.describe()}) "
                "when it started, before this call could hook its layers, and neither a compiled graph nor a CUDA "
                "graph runs hooks added later; expected an eager engine: start vLLM with enforce_eager=True, or "
                "configure hscapture when the engine starts (additional_config) to capture under vLLM's defaults"
            )
        cfg = CaptureConfig(layers=tuple(int(i) for i in layer_ids), convention="after", out=None)
        old = getattr(self, "_hscapture", None)
        if old is not None:
            old.close()
        cls = getattr(self, "capture_cls", None) or WorkerCapture
        self._hscapture = cls.from_worker(self, cfg)
        if not getattr(type(self), "_hscapture_brackets_steps", False) and "execute_model" not in vars(self):
            base = self.execute_model

            def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any):
                return run_step(self, base, scheduler_output, *args, **kwargs)

            self.execute_model = execute_model

    def _reset_capture(self) -> None:
        """Drops every captured sample and the driver's metadata (before a new batch)."""
        self._hscapture_session("_reset_capture").rpc.reset()

    def _set_request_metadata(self, request_metadata: dict[str, int]) -> None:
        """The driver's view of the next step: request id → prompt tokens it contributes."""
        if not isinstance(request_metadata, dict):
            raise AttributionError(
                f"_set_request_metadata: expected a dict of request id -> prompt tokens, found {type(request_metadata).__name__}"
            )
        self._hscapture_session("_set_request_metadata").rpc.expect_rows(request_metadata)

    def _store_captured_states(self, aux_hidden_states: list) -> None:
        """Captures externally read per-layer tensors (``[T, H]`` each, the step's rows) for the step in
        progress, through the same attribution and contract as the hooks."""
        self._hscapture_session("_store_captured_states").rpc.store(aux_hidden_states)

    def _get_captured_states(self):
        """``{req_id: [per-layer [L, H]]}`` (driver sent metadata), else one ``[ΣL, H]`` per layer;
        ``None`` when nothing was captured (and on ranks that do not assemble)."""
        return self._hscapture_session("_get_captured_states").rpc.collect()
