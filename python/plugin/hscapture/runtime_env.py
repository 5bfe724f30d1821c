"""Environment vLLM needs on a machine without a GPU (see docs/compatibility.md).

Applied by the CLI before vLLM is imported; a value the user set is never overridden.
"""

from __future__ import annotations

import json
import os


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def omp_binding(world_size: int, cores: int | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND``: the cores split evenly, one group per worker ('auto' fails on small boxes)."""
    n = cores or os.cpu_count() or 1
    if world_size > n:
        return "nobind"
    per = n // world_size
    groups = []
    for r in range(world_size):
        lo, hi = r * per, r * per + per - 1
        groups.append(str(lo) if lo == hi else f"{lo}-{hi}")
    return "|".join(groups)


def cpu_defaults(world_size: int) -> dict[str, str]:
    return {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": omp_binding(world_size),
        "VLLM_HOST_IP": "127.0.0.1",
        "TORCHINDUCTOR_VEC_ISA_OK": "1",
    }


MARK = "HSCAPTURE_RUNTIME_ENV"


def _ours() -> dict[str, str]:
    """What hscapture itself set, recorded in the environment so that child processes know too."""
    try:
        return json.loads(os.environ.get(MARK, "{}"))
    except ValueError:
        return {}


def apply(world_size: int) -> dict[str, str]:
    """Sets the CPU defaults the user did not set (on CPU only); returns what was set. Values set by an
    earlier call (another world size, in this process or a parent) are updated; the user's never are."""
    if has_cuda():
        return {}
    ours, applied = _ours(), {}
    for k, v in cpu_defaults(world_size).items():
        if k not in os.environ or os.environ[k] == ours.get(k):
            os.environ[k] = ours[k] = applied[k] = v
    os.environ[MARK] = json.dumps(ours)
    return applied
