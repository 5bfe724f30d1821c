"""hscapture's settings checked where vLLM builds its configuration — in the caller's process, before any
engine starts — instead of in the workers, where a ``ConfigError`` reaches an ``LLM(...)`` caller only as
"Engine core initialization failed".

vLLM loads hscapture's general plugin in the process that builds an ``EngineArgs`` (``LLM(...)``, ``vllm serve``);
the plugin wraps ``EngineArgs.create_engine_config`` (feature-detected) so that the configuration it returns is
checked: every ``additional_config["hscapture"]`` value's type and range, the layer ids against the model's
depth, and a worker class that captures at all (settings without ``--worker-cls hscapture.worker.CaptureWorker``
would capture nothing). The workers check the same again, for callers that build a ``VllmConfig`` otherwise.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from ..errors import ConfigError
from .parallel import refuse_stages_with_tp
from .requested import NAME, capture_config
from .vllm_compat import refuse_prompt_embeds

log = logging.getLogger("hscapture")

_WRAPPED = "__hscapture_checked__"


def check(vllm_config: Any) -> None:
    """Raises ``ConfigError`` for settings that a worker would refuse (or silently ignore)."""
    cfg = capture_config(vllm_config)
    if cfg is None:
        return
    mc = vllm_config.model_config
    text = getattr(mc, "hf_text_config", None) or mc.hf_config
    cfg.resolve(int(text.num_hidden_layers))
    refuse_prompt_embeds(mc)
    pc = vllm_config.parallel_config
    refuse_stages_with_tp(int(getattr(pc, "pipeline_parallel_size", 1)), int(getattr(pc, "tensor_parallel_size", 1)))
    worker_cls = getattr(vllm_config.parallel_config, "worker_cls", "auto")
    if not _captures(worker_cls):
        raise ConfigError(
            f'additional_config["hscapture"] asks for layers {list(cfg.layers)}, but the worker class is {worker_cls!r}, '
            "which does not capture: expected hscapture's worker; add --worker-cls hscapture.worker.CaptureWorker "
            '(LLM(worker_cls="hscapture.worker.CaptureWorker"))'
        )


def _captures(worker_cls: Any) -> bool:
    if isinstance(worker_cls, str):
        if worker_cls == "auto":
            return False
        from .vllm_compat import resolve_qualname

        try:
            worker_cls = resolve_qualname(worker_cls)
        except Exception:  # noqa: BLE001 - a class this process cannot import: the workers will tell
            return True
    from ..worker import CaptureWorker

    return isinstance(worker_cls, type) and issubclass(worker_cls, CaptureWorker)


def asks_for_capture(engine_args: Any) -> bool:
    """Whether these engine arguments configure hscapture's capture (its settings, or its KV connector)."""
    extra = getattr(engine_args, "additional_config", None)
    kv = getattr(engine_args, "kv_transfer_config", None)
    kv_name = kv.get("kv_connector") if isinstance(kv, dict) else getattr(kv, "kv_connector", None)
    return (isinstance(extra, dict) and "hscapture" in extra) or kv_name == NAME


def prefix_caching_off(engine_args: Any) -> None:
    """A prompt prefix served from vLLM's prefix cache is never computed, so its states cannot be captured: under
    hscapture prefix caching is off unless asked for (then refused), with one log line saying so."""
    from ..errors import ConfigError

    if not asks_for_capture(engine_args) or not hasattr(engine_args, "enable_prefix_caching"):
        return
    if engine_args.enable_prefix_caching is None:
        engine_args.enable_prefix_caching = False
        log.info(
            "hscapture: prefix caching is off (a cached prompt prefix is never computed, so its hidden states "
            "could not be captured)"
        )
    elif engine_args.enable_prefix_caching:
        raise ConfigError(
            "prefix caching is on (--enable-prefix-caching): a prompt prefix served from vLLM's cache is never "
            "computed, so its hidden states could not be captured; expected it off: drop the flag (hscapture turns "
            "it off) or pass --no-enable-prefix-caching"
        )


def install() -> bool:
    """Wraps ``EngineArgs.create_engine_config`` once per process; False where vLLM has no such method."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return False
    original = getattr(EngineArgs, "create_engine_config", None)
    if original is None or getattr(original, _WRAPPED, False):
        return original is not None

    @functools.wraps(original)
    def create_engine_config(self, *args: Any, **kwargs: Any) -> Any:
        prefix_caching_off(self)
        vllm_config = original(self, *args, **kwargs)
        check(vllm_config)
        return vllm_config

    setattr(create_engine_config, _WRAPPED, True)
    EngineArgs.create_engine_config = create_engine_config
    return True
