"""A KV connector that moves nothing: vLLM's connector plumbing alone (the scheduler's calls, the runner's
pre/post-forward, the per-attention-layer wrapper, block hashing), for ``bench/gpu_run.py``'s ``*_noopconn`` modes.
Is the eager decode gap of hscapture's connector vLLM's price for any connector, or hscapture's own? (The methods
that move no KV cache are hscapture's ``NoKVTransfer``: no capture, no file, no metadata.)"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

from hscapture.connector import NoKVTransfer


class NoopConnector(NoKVTransfer, KVConnectorBase_V1):
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
