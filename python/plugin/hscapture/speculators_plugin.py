"""vLLM general plugin (entry point ``vllm.general_plugins``): puts speculators' offline generator on
hscapture when ``HSCAPTURE_SPECULATORS=1``.

vLLM loads general plugins in every process it starts, and in each worker before it resolves
``worker_extension_cls``. There, this replaces
``speculators.data_generation.custom_worker.HiddenStatesWorkerExtension`` with
``hscapture.rpc.HiddenStatesRPC``. In the driver it applies the generator module's shims if the
module is loaded. Idempotent and re-entrant; does nothing unless switched on.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("hscapture")

EXTENSION_MODULE = "speculators.data_generation.custom_worker"
EXTENSION_NAME = "HiddenStatesWorkerExtension"


def enabled() -> bool:
    from . import envs

    return bool(envs.get("HSCAPTURE_SPECULATORS"))


def swap_extension() -> bool:
    """Points speculators' extension name at hscapture's; False if speculators is not installed."""
    try:
        import importlib

        mod = importlib.import_module(EXTENSION_MODULE)
    except ImportError as e:
        log.debug("hscapture: speculators not importable here (%s); nothing to swap", e)
        return False
    from .rpc import HiddenStatesRPC

    if getattr(mod, EXTENSION_NAME, None) is not HiddenStatesRPC:
        setattr(mod, EXTENSION_NAME, HiddenStatesRPC)
        log.info("hscapture: %s.%s -> hscapture.rpc.HiddenStatesRPC", EXTENSION_MODULE, EXTENSION_NAME)
    return True


def shim_generator() -> list[str]:
    from .patches import apply_generator_shims
    from .patches.speculators_driver import GENERATOR

    mod = sys.modules.get(GENERATOR)
    return apply_generator_shims(mod) if mod is not None else []


def register() -> None:
    if not enabled():
        return
    swap_extension()
    shim_generator()
