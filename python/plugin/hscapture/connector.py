"""hscapture's KV-connector face: the hidden-states server contract of speculators ≥ 0.5 (its
``generate-offline-data`` and online training), on hscapture's capture.

    vllm serve MODEL --worker-cls hscapture.worker.CaptureWorker \\
      --additional-config '{"hscapture": {"layers": [2, 16, 29, 32], "convention": "before"}}' \\
      --kv-transfer-config '{"kv_connector": "HscaptureConnector", "kv_connector_module_path": "hscapture.connector",
                             "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": "DIR",
                             "format": "file"}}'

The capture is ``CaptureWorker``'s, as always (hooks, attribution, the contract, the TP check); the connector tells
the workers to write per-request files (``DIR/<request id>.safetensors``, ``output/sinks/staging.rs``) and answers each
finished request with ``kv_transfer_params = {"hidden_states_path": ...}``. The writing worker holds
``<path>.lock`` from the step in which the request's prompt completes — before vLLM can answer it — until the file
is renamed into place, so a client that waits for the lock (speculators does) reads a whole file. A capture that
fails stops the engine, so the requests in flight get an error response.

``kv_connector_extra_config`` keys: ``shared_storage_path`` (required), ``format`` (``file``: the model's or the
store dtype; ``fp8``), and, as shorter spellings of ``additional_config["hscapture"]``, ``layers``,
``convention`` and ``dtype``. Nothing of the KV cache is read or written: this connector only carries the
contract. A request whose ``kv_transfer_params`` set ``include_output_tokens`` gets the states of every token that
went through a forward — its prompt and its generated tokens but the last — in one generation: the workers capture
its decode rows too, and the scheduler sends them its token ids when it finishes (``HscaptureMetadata``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from . import _native
from .adapters.requested import capture_config, settings
from .adapters.vllm_compat import include_output_tokens, max_tokens
from .errors import ConfigError, HscaptureError


class HscaptureMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers each step: the token ids (all but the last: every token that went
    through a forward) of the requests that capture their generated tokens and finished since the last step."""

    hscapture = True  # read by vllm_compat.step_of without importing this module

    def __init__(self, outputs: dict[str, list[int]] | None = None) -> None:
        self.outputs = outputs or {}


def hidden_states_path(out: str, request_id: str) -> str:
    """Where the workers write request ``request_id``'s sample (the same name the Rust sink gives it)."""
    return os.path.join(out, _native.staged_file_name(request_id))


class NoKVTransfer:
    """A KV connector's methods for moving KV cache, when it moves none: nothing is loaded (every prompt token is
    computed, and captured), nothing is saved. Mixed in before ``KVConnectorBase_V1``."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


class HscaptureConnector(NoKVTransfer, KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        found = settings(vllm_config)
        if found is None:  # configured under another name: nothing this class can serve
            raise ConfigError(f"{type(self).__name__} is configured as {vllm_config.kv_transfer_config.kv_connector!r}")
        self.out = found.get("out")
        self.store = False  # samples leave as packed objects in a Mooncake store (a manifest answers), not files
        self.output: Any = None  # the workers' output, described: it decides which growing samples are refused
        self.rows: tuple[int, int, str] | None = None  # (layers, hidden size, dtype) of a captured row
        self.outputs: dict[str, list[int]] = {}  # finished requests with generated tokens, for the next step
        self.vllm_config = vllm_config  # its worker's capture, when in this process and thread (capture/inproc.py)
        if role == KVConnectorRole.SCHEDULER:
            from .adapters.early_check import check

            check(vllm_config)  # the capture must be set up (a worker class that captures, valid settings)
            from .adapters.requested import destination, max_growing_sample_mib, outputs_refused
            from .capture.wiring import model_facts

            cfg = capture_config(vllm_config)
            n_layers, hidden, model_dtype, _ = model_facts(vllm_config)
            slots, dtype = len(cfg.resolve(n_layers)), model_dtype if cfg.dtype == "auto" else cfg.dtype
            described = destination(cfg)  # the workers' own description
            self.output = _native.Output.described(
                described, max_growing_sample_mib=max_growing_sample_mib(), outputs_refused=outputs_refused(vllm_config)
            )
            self.rows = (slots, hidden, dtype)
            self.store = described["kind"] == "store"

    # -- the scheduler side (what moves no KV cache is NoKVTransfer's) ------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """The workers read the scheduler output itself; this adds the token ids of the requests with generated
        tokens that finished (reported in this same scheduler output's ``finished_req_ids``)."""
        meta, self.outputs = HscaptureMetadata(self.outputs), {}
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        """The answer's ``kv_transfer_params``: where the request's states are — a file, whole once its lock (held
        from the step the prompt completed in) is released; or a Mooncake object's transfer manifest (the object,
        or its error marker, appears once the put is over). None for a request with generated tokens that ended
        before its first one (aborted). A request whose sample could outgrow the bound on growing samples was
        refused at admission by the workers (the same rule): its answer carries ``hidden_states_error``, no path."""
        prompt = list(getattr(request, "prompt_token_ids", None) or ())
        rows, mode = len(prompt), "prompt_only"
        if include_output_tokens(getattr(request, "kv_transfer_params", None)):
            why = self._refusal(request, len(prompt))
            if why is not None:
                return False, {"hidden_states_error": why}
            every = list(request.all_token_ids)
            rows = _native.output_sample_rows(len(prompt), len(every))  # the workers decide by the same rule
            if rows is None:
                return False, None  # ended before its first output (aborted): no sample, its workers drop its rows
            tokens = [int(t) for t in every[:rows]]  # the last token was sampled, never an input to a forward
            why = self._finish(request.request_id, tokens)
            if why is not None:
                return False, {"hidden_states_error": why}
            rows, mode = len(tokens), "all"
        if not self.store or self.rows is None:
            return False, {"hidden_states_path": hidden_states_path(self.out, request.request_id)}
        slots, width, dtype = self.rows
        return False, json.loads(_native.packed_manifest(request.request_id, rows, slots, width, dtype, mode))

    def _finish(self, req_id: str, tokens: list[int]) -> str | None:
        """Hands a finished request's tokens to the workers: at once to a worker's capture in this process and thread
        (an engine in the caller's process steps no more after a call's last request: ``capture/inproc.py``), else
        with the next step's metadata. A capture that failed answers why its sample will not come."""
        from .capture import inproc

        cap = inproc.capture_for(self.vllm_config)
        try:
            if cap is not None and inproc.finish_outputs(cap, {req_id: tokens}):
                return None
        except HscaptureError as e:
            return f"the capture failed, so this request's states were not stored: {e}"
        self.outputs[req_id] = tokens
        return None

    def _refusal(self, request: Any, prompt_len: int) -> str | None:
        n = max_tokens(getattr(request, "sampling_params", None))
        if self.output is None or self.rows is None:
            return None
        return self.output.growing_refusal(*self.rows, request.request_id, prompt_len, n)
