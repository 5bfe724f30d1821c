"""Shims for speculators' offline generator drivers (``VllmHiddenStatesGenerator``), applied to the
generator module's own namespace so that the script runs unchanged. Each function returns True if it
changed something. Probes look at the installed vLLM and at the driver, never at version strings."""

from __future__ import annotations

import functools
import inspect
from types import ModuleType

GENERATOR = "speculators.data_generation.vllm_hidden_states_generator"


def _wrap_once(module: ModuleType, name: str, make) -> bool:
    obj = getattr(module, name, None)
    if obj is None or getattr(obj, "__hscapture_shim__", False):
        return False
    wrapped = make(obj)
    wrapped.__hscapture_shim__ = True
    setattr(module, name, wrapped)
    return True


# -- mem_get_info on CPU ----------------------------------------------------------------------------
def host_mem_get_info() -> tuple[int, int]:
    """(free, total) of host memory, capped at 8 GiB free: the CPU build's KV cache lives there."""
    import psutil

    vm = psutil.virtual_memory()
    return min(int(vm.available), 8 << 30), int(vm.total)


def mem_get_info_needed(module: ModuleType) -> bool:
    import torch

    return not torch.cuda.is_available()


def mem_get_info_apply(module: ModuleType) -> bool:
    import torch

    changed = False
    if hasattr(module, "mem_get_info") and not getattr(module.mem_get_info, "__hscapture_shim__", False):
        host_mem_get_info.__hscapture_shim__ = True
        module.mem_get_info = host_mem_get_info  # speculators 0.4: its own helper (accelerator memory)
        changed = True
    if not getattr(torch.cuda.mem_get_info, "__hscapture_shim__", False):

        def cuda_mem_get_info(device=None):
            return host_mem_get_info()

        cuda_mem_get_info.__hscapture_shim__ = True
        torch.cuda.mem_get_info = cuda_mem_get_info  # speculators 0.3 calls it directly; CPU-only process
        changed = True
    return changed


# -- vLLM's CPU environment, sized when the generator picks its parallelism ---------------------------
def cpu_env_needed(module: ModuleType) -> bool:
    import torch

    return not torch.cuda.is_available() and hasattr(module, "ParallelConfig")


def cpu_env_apply(module: ModuleType) -> bool:
    from .. import runtime_env

    def make(cls):
        @functools.wraps(cls, updated=())
        def ParallelConfig(*args, **kwargs):
            world = int(kwargs.get("tensor_parallel_size", 1)) * int(kwargs.get("pipeline_parallel_size", 1))
            runtime_env.apply(world)  # before the workers are spawned; the user's own values are kept
            return cls(*args, **kwargs)

        return ParallelConfig

    return _wrap_once(module, "ParallelConfig", make)


# -- SchedulerConfig(is_encoder_decoder=...) --------------------------------------------------------
def _required_field(cls, name: str) -> bool:
    import dataclasses

    fields = getattr(cls, "__dataclass_fields__", {})
    f = fields.get(name)
    return f is not None and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def scheduler_config_needed(module: ModuleType) -> bool:
    cls = getattr(module, "SchedulerConfig", None)
    return (
        cls is not None
        and _required_field(cls, "is_encoder_decoder")
        and "is_encoder_decoder" not in inspect.getsource(module)
    )


def scheduler_config_apply(module: ModuleType) -> bool:
    def make(cls):
        @functools.wraps(cls, updated=())
        def SchedulerConfig(*args, **kwargs):
            kwargs.setdefault("is_encoder_decoder", False)  # a decoder-only target, as the generator assumes
            return cls(*args, **kwargs)

        return SchedulerConfig

    return _wrap_once(module, "SchedulerConfig", make)


# -- prefix caching, on by default in vLLM's V1 engine ----------------------------------------------
def _field_default(cls, name: str):
    import dataclasses

    f = getattr(cls, "__dataclass_fields__", {}).get(name)
    if f is None:
        return dataclasses.MISSING
    return f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING


def prefix_caching_needed(module: ModuleType) -> bool:
    cls = getattr(module, "CacheConfig", None)
    if cls is None or "enable_prefix_caching" in inspect.getsource(module):
        return False
    default = _field_default(cls, "enable_prefix_caching")
    return default is not False  # True, or None meaning "decided by vLLM" (on for V1)


def prefix_caching_apply(module: ModuleType) -> bool:
    def make(cls):
        @functools.wraps(cls, updated=())
        def CacheConfig(*args, **kwargs):
            kwargs.setdefault("enable_prefix_caching", False)
            return cls(*args, **kwargs)

        return CacheConfig

    return _wrap_once(module, "CacheConfig", make)


# -- keyword arguments a callee no longer takes, and block_size the Scheduler now requires ------------
def _drop_unknown_kwargs(fn):
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return fn(*args, **{k: v for k, v in kwargs.items() if k in params})

    return call


def kv_cache_kwargs_needed(module: ModuleType) -> bool:
    fn = getattr(module, "get_kv_cache_config_from_groups", None)
    if fn is None:
        return False
    src = inspect.getsource(module)
    return "kv_cache_specs=" in src and "kv_cache_specs" not in inspect.signature(fn).parameters


def kv_cache_kwargs_apply(module: ModuleType) -> bool:
    return _wrap_once(module, "get_kv_cache_config_from_groups", _drop_unknown_kwargs)


def scheduler_block_size_needed(module: ModuleType) -> bool:
    cls = getattr(module, "Scheduler", None)
    if cls is None:
        return False
    p = inspect.signature(cls.__init__).parameters.get("block_size")
    return (
        p is not None
        and p.default is inspect.Parameter.empty
        and "block_size=" not in inspect.getsource(module.VllmHiddenStatesGenerator.__init__)
    )


def scheduler_block_size_apply(module: ModuleType) -> bool:
    def make(cls):
        class Scheduler(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *args, **kwargs):
                if "block_size" not in kwargs and len(args) < 4:
                    cfg = kwargs.get("vllm_config", args[0] if args else None)
                    kwargs["block_size"] = cfg.cache_config.block_size
                super().__init__(*args, **kwargs)

        Scheduler.__name__ = Scheduler.__qualname__ = cls.__name__
        return Scheduler

    return _wrap_once(module, "Scheduler", make)


# -- collective_rpc(..., unique_reply_rank=r): a bare value since vLLM 0.12, a list before -------------
def unique_reply_needed(module: ModuleType) -> bool:
    """A driver written for the old return shape indexes [0] into the reply and never sends request
    metadata (speculators 0.3); vLLM 0.12+ returns the bare value."""
    if not hasattr(module, "MultiprocExecutor"):
        return False
    src = inspect.getsource(module)
    executor_src = inspect.getsource(module.MultiprocExecutor.collective_rpc)
    returns_bare = "responses[0] if output_rank is not None" in executor_src or "unique_reply_rank" in executor_src
    return returns_bare and "unique_reply_rank" in src and "_set_request_metadata" not in src


def unique_reply_apply(module: ModuleType) -> bool:
    def make(cls):
        class MultiprocExecutor(cls):  # type: ignore[misc, valid-type]
            def collective_rpc(self, method, *args, unique_reply_rank=None, **kwargs):
                out = super().collective_rpc(method, *args, unique_reply_rank=unique_reply_rank, **kwargs)
                return [out] if unique_reply_rank is not None else out

        MultiprocExecutor.__name__ = MultiprocExecutor.__qualname__ = cls.__name__
        return MultiprocExecutor

    return _wrap_once(module, "MultiprocExecutor", make)
