"""``extract --vllm-arg KEY=VALUE``: vLLM's own engine arguments, passed through to ``vllm.LLM``.

A large model needs settings hscapture has no flag for (``gpu_memory_utilization``, ``enable_expert_parallel``,
``quantization``, ``kv_cache_dtype``, ``max_num_seqs``, ``hf_overrides``...). Each is checked before vLLM starts:
the key must be one of vLLM's ``EngineArgs`` fields (a typo is named, with the nearest fields), and the keys
hscapture sets itself are refused with the flag that sets them.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json

from ..errors import ConfigError

# Keys hscapture owns, and what to use instead.
_OWNED = {
    "model": "--model",
    "tensor_parallel_size": "--tp",
    "pipeline_parallel_size": "--pp",
    "dtype": "--dtype",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_model_len": "--max-model-len",
    "distributed_executor_backend": "--executor",
    "enforce_eager": "--compile (hscapture runs vLLM eager unless --compile is given)",
    "trust_remote_code": '--trust-remote-code (it also applies to the tokenizer of "text" prompts)',
    "skip_tokenizer_init": "nothing: hscapture loads vLLM's tokenizer only when the model directory has one",
    "tokenizer": '--tokenizer (hscapture tokenizes "text" prompts itself; vLLM gets token ids)',
    "worker_cls": "nothing: hscapture runs vLLM with its own worker class",
    "worker_extension_cls": "nothing: hscapture's worker class carries the capture; an extension would not be loaded "
    "the way hscapture expects",
    "additional_config": "hscapture's own flags: it passes its settings to the workers this way",
}
_WORDS = {"true": True, "false": False, "null": None, "none": None}


def _value(text: str, annotation: str):
    """True/False/None in any case; otherwise JSON when it parses (numbers, objects, lists, quoted strings), else
    the text itself; a number stays text for a field that takes text but no number (a revision such as 1234567)."""
    word = text.strip().lower()
    if word in _WORDS:
        return _WORDS[word]
    try:
        value = json.loads(text)
    except ValueError:
        return text
    kinds = set(annotation.replace(" ", "").replace("typing.", "").replace("Optional[str]", "str").split("|"))
    if isinstance(value, (int, float)) and "str" in kinds and not kinds & {"int", "float", "Any"}:
        return text
    return value


def engine_fields() -> dict[str, str]:
    """The names vLLM's ``EngineArgs`` accepts (what ``LLM(**kwargs)`` hands it), with their annotations."""
    from vllm.engine.arg_utils import EngineArgs

    def text(t) -> str:
        return t if isinstance(t, str) else t.__name__ if isinstance(t, type) else str(t)

    return {f.name: text(f.type) for f in dataclasses.fields(EngineArgs)}


def cli_actions() -> dict:
    """vLLM's own command-line arguments for its engine (``EngineArgs.add_cli_args``) by field name: how vLLM
    itself reads each value from text. Empty when this vLLM has no such parser."""
    try:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        return {}
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return {a.dest: a for a in parser._actions if a.option_strings}


def check_value(key: str, text: str, value, action) -> None:
    """``text`` read as vLLM's own parser reads ``--key``; a value it refuses is a ``ConfigError`` naming both."""
    if action is None:
        return
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        if not isinstance(value, bool):
            raise ConfigError(f"--vllm-arg {key}={text}: vLLM's {flag} is a switch; expected true or false")
        return
    if value is None:
        return  # None leaves vLLM's default
    parts = value if isinstance(value, list) and action.nargs in ("+", "*") else [value]
    for part in parts:
        raw = part if isinstance(part, str) else json.dumps(part) if isinstance(part, (dict, list)) else str(part)
        try:
            parsed = action.type(raw) if callable(action.type) else raw
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            raise ConfigError(
                f"--vllm-arg {key}={text}: vLLM reads {flag} as {_kind(action)} and refuses this value ({e})"
            ) from None
        if action.choices is not None and parsed not in action.choices:
            raise ConfigError(f"--vllm-arg {key}={text}: vLLM's {flag} takes one of {sorted(map(str, action.choices))}")


def _kind(action) -> str:
    t = action.type
    return getattr(t, "__name__", "its own type") if t is not None else "text"


def parse(items: list[str] | None, fields: dict[str, str] | None = None, actions: dict | None = None) -> dict:
    """``["gpu_memory_utilization=0.9", "enable-expert-parallel=true"]`` -> keyword arguments for ``vllm.LLM``.
    Dashes in a key read as underscores, as on vLLM's command line. Raises :class:`ConfigError` naming the item."""
    out: dict = {}
    if not items:
        return out
    known = engine_fields() if fields is None else fields
    actions = cli_actions() if actions is None else actions
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(
                f"--vllm-arg expects KEY=VALUE (one of vLLM's engine arguments, e.g. "
                f"gpu_memory_utilization=0.9), found {item!r}"
            )
        if key in out:
            raise ConfigError(f"--vllm-arg {key} is given twice ({out[key]!r} and {text!r}); give it once")
        if key in _OWNED:
            raise ConfigError(f"--vllm-arg {key}: hscapture sets this itself; use {_OWNED[key]}")
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"; nearest: {', '.join(near)}" if near else ""
            raise ConfigError(f"--vllm-arg {key}: not one of vLLM's engine arguments (vllm.EngineArgs fields){hint}")
        value = _value(text, known[key])
        if key == "enable_prefix_caching" and value is not False:
            raise ConfigError(
                f"--vllm-arg enable_prefix_caching={text}: a prompt prefix served from vLLM's cache is "
                "never computed, so its states would be missing; hscapture turns prefix caching off "
                "(false is the only value accepted)"
            )
        check_value(key, text, value, actions.get(key))
        out[key] = value
    return out
