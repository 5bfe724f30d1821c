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

from . import vllm_compat
from .errors import AttributionError, CompatibilityError, ConfigError, ShapeContractError

_HOW = "call _setup_hidden_states_capture(layer_ids) first"


def _split_layers(d: dict) -> list:
    """A sample from ``take_samples`` as one ``[L, H]`` tensor per layer."""
    import torch

    t = torch.frombuffer(bytearray(d["data"]), dtype=getattr(torch, d["dtype"])).reshape(d["shape"])
    return [t[:, k, :].clone() for k in range(t.shape[1])]


class RpcState:
    """What speculators' drivers add to a capture: their own view of each step (``expect_rows``, checked
    against hscapture's attribution at the step's end), the order the scheduler admitted requests in (0.3's
    driver slices the concatenated states back in that order), and the shape of the answer."""

    def __init__(self, cap: Any) -> None:
        self.cap = cap
        self.expected: dict[str, int] | None = None
        self.metadata_seen = False
        self.admitted: list[str] = []
        self._admitted_set: set[str] = set()

    def admit(self, scheduler_output: Any) -> None:
        for r in scheduler_output.scheduled_new_reqs:
            if r.req_id not in self._admitted_set:
                self._admitted_set.add(r.req_id)
                self.admitted.append(r.req_id)

    def expect_rows(self, metadata: dict) -> None:
        self.expected = dict(metadata)
        self.metadata_seen = True

    def check_step(self, session: Any) -> None:
        """At the step's end: the driver's metadata (if it sent any) must name the rows hscapture attributed."""
        expected, self.expected = self.expected, None
        if expected is None:
            return
        ours = dict(session.step_rows())
        theirs = {str(k): int(v) for k, v in expected.items() if int(v) > 0}
        if ours != theirs:
            diff = sorted(set(ours) | set(theirs))
            lines = [
                f"{r}: hscapture {ours.get(r, 0)}, driver {theirs.get(r, 0)}"
                for r in diff
                if ours.get(r, 0) != theirs.get(r, 0)
            ]
            if session.in_step:
                session.abandon_step()
            raise AttributionError(
                "the driver's request metadata disagrees with the scheduler output about which prompt tokens this step "
                f"holds ({'; '.join(lines[:8])}); the driver's own bookkeeping has drifted (preemption? chunked prefill?) "
                "— hscapture attributes by the scheduler output, which is what the model ran"
            )

    def reset(self) -> None:
        self.cap.session.take_samples()
        self.cap.session.take_aborted()
        self.expected, self.metadata_seen = None, False
        self.admitted, self._admitted_set = [], set()

    def store(self, aux_hidden_states: list) -> None:
        cap = self.cap
        if not cap._active:
            raise AttributionError(
                "_store_captured_states was called outside a step; states belong to the step that computed them"
            )
        if len(aux_hidden_states) != len(cap.layer_ids):
            raise ShapeContractError(
                f"_store_captured_states: expected {len(cap.layer_ids)} tensors (layers {cap.layer_ids}), found {len(aux_hidden_states)}"
            )
        for slot, t in enumerate(aux_hidden_states):
            cap.capture(slot, t, None)

    def collect(self):
        import torch

        cap = self.cap
        cap.flush()
        if not cap.writer_rank:
            return None
        samples = {d["request_id"]: d for d in cap.session.take_samples()}
        if not samples:
            return None
        layers = {rid: _split_layers(d) for rid, d in samples.items()}
        if self.metadata_seen:
            return layers
        missing = [r for r in self.admitted if r not in layers]
        if missing:
            raise AttributionError(
                f"{len(missing)} admitted requests have no complete states (first: {missing[:5]}): the driver finished "
                "them before their prefill was done (a request split across steps by chunked prefill and aborted after "
                "its first chunk?); raise max_num_batched_tokens above the longest prompt"
            )
        order = [r for r in self.admitted if r in layers]
        return [torch.cat([layers[r][k] for r in order], dim=0) for k in range(len(cap.layer_ids))]


class HiddenStatesRPC:
    def _hscapture_session(self, what: str):
        cap = getattr(self, "_hscapture", None)
        if cap is None:
            raise ConfigError(f"{what}: hidden-state capture is not set up on this worker; {_HOW}")
        return cap

    def _setup_hidden_states_capture(self, layer_ids: list[int]) -> None:
        """Captures ``layer_ids`` (``after`` convention) from now on, keeping samples in memory."""
        from .capture import WorkerCapture, run_step
        from .config import CaptureConfig

        if not isinstance(layer_ids, (list, tuple)):
            raise ConfigError(
                f"_setup_hidden_states_capture: expected a list of layer ids, found {type(layer_ids).__name__}"
            )
        if vllm_compat.compiled(getattr(self, "vllm_config", None)):
            raise CompatibilityError(
                "_setup_hidden_states_capture: vLLM compiled the model (torch.compile) when it started, before this "
                "call could hook its layers, and a compiled graph never runs hooks added later; expected an eager "
                "engine: start vLLM with enforce_eager=True"
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
