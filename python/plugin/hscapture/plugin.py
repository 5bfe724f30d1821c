"""hscapture's vLLM general plugin (entry point ``vllm.general_plugins``), which vLLM loads in every process
it starts (the driver, the engine, each worker, before it resolves ``worker_extension_cls``):

- in processes started for ``hscapture extract``: they die with their parent (``lifetime.py``);
- where vLLM builds its configuration: hscapture's settings are checked there (``early_check.py``);
- with ``HSCAPTURE_SPECULATORS=1``: speculators 0.3/0.4's offline generator runs on hscapture — its
  ``speculators.data_generation.custom_worker.HiddenStatesWorkerExtension`` is replaced with
  ``hscapture.rpc.HiddenStatesRPC``, and in the driver the generator module's shims are applied if it is loaded.

Idempotent and re-entrant.
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
    from .adapters import early_check
    from .lifetime import die_with_parent

    die_with_parent()
    early_check.install()
    if not enabled():
        return
    swap_extension()
    shim_generator()
