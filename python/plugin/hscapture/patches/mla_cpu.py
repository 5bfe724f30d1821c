"""Shim ``mla_cpu``: DeepSeek (MLA) models on vLLM CPU builds that refuse MLA."""

from __future__ import annotations

import os
from types import SimpleNamespace


def uses_mla(model_config: dict) -> bool:
    text = model_config.get("text_config") or model_config
    return bool(text.get("kv_lora_rank")) and "deepseek" in str(
        text.get("model_type", model_config.get("model_type", ""))
    )


def cpu_refuses_mla() -> bool:
    """Asks the CPU platform's attention selector for an MLA backend; True if it refuses."""
    try:
        from vllm.platforms.cpu import CpuPlatform
    except ImportError:
        return False
    cfg = SimpleNamespace(
        use_mla=True,
        use_sparse=False,
        head_size=576,
        dtype=None,
        kv_cache_dtype=None,
        block_size=16,
        has_sink=False,
        use_mm_prefix=False,
        attn_type=None,
    )
    try:
        CpuPlatform.get_attn_backend_cls(None, cfg)
    except NotImplementedError as e:
        return "MLA" in str(e)
    except Exception:  # noqa: BLE001 - the probe's own call failed some other way: the selector does not refuse MLA
        return False
    return False


def on_cpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return False


def needed(model_config: dict) -> bool:
    return uses_mla(model_config) and on_cpu() and cpu_refuses_mla() and os.environ.get("VLLM_MLA_DISABLE") != "1"


def apply(model_config: dict) -> bool:
    os.environ["VLLM_MLA_DISABLE"] = "1"
    return True
