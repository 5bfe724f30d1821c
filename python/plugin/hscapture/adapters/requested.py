"""What a vLLM configuration asks of hscapture: its KV connector's settings (``kv_transfer_config``, read without
importing vLLM's connector classes), the capture they and ``additional_config["hscapture"]`` make together, and
where its samples go (``destination``: the one description the core's ``Output`` takes). Read by the connector,
the early check in the caller's process and the workers."""

from __future__ import annotations

import os
from typing import Any

from .. import _native, envs
from ..config import from_sources
from ..errors import ConfigError
from ..output import formats

NAME = "HscaptureConnector"
# Every name (and alias) of a format served as per-request files, and the object store's (the core's facts).
FORMATS = {
    **{n: f.name for f in formats.FORMATS.values() if f.per_request_files for n in (f.name, *f.aliases)},
    _native.STORE_FORMAT: _native.STORE_FORMAT,
}
# extra-config keys that are additional_config["hscapture"] settings too (the shorter spelling)
SETTINGS = ("layers", "convention", "dtype")
KEYS = {"shared_storage_path", "format", "mooncake", *SETTINGS}


def settings(vllm_config: Any) -> dict | None:
    """The connector's settings of ``vllm_config`` (None unless this connector is configured), checked."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None or getattr(kv, "kv_connector", None) != NAME:
        return None
    extra = dict(getattr(kv, "kv_connector_extra_config", None) or {})
    where = 'kv_transfer_config["kv_connector_extra_config"]'
    unknown = set(extra) - KEYS
    if unknown:
        raise ConfigError(f"{where} has unknown keys {sorted(unknown)}; {NAME} takes {sorted(KEYS)}")
    fmt = extra.get("format", "file")
    if fmt not in FORMATS:
        raise ConfigError(
            f'{where}["format"] is {fmt!r}; expected "file" (the states as captured), "fp8" or "mooncake" (objects in a '
            "Mooncake store, for online training)"
        )
    shorter = {k: extra[k] for k in SETTINGS if k in extra}
    if FORMATS[fmt] == _native.STORE_FORMAT:
        from ..output import mooncake

        if "shared_storage_path" in extra:
            raise ConfigError(
                f'{where}["shared_storage_path"] is set with format "mooncake", which writes no files; remove it'
            )
        store = mooncake.settings(extra.get("mooncake"), f'{where}["mooncake"]')
        if "num_writer_threads" in (extra.get("mooncake") or {}):  # speculators' name for the writer's threads
            shorter["writer_threads"] = store["num_writer_threads"]
        return {"mooncake": store, **shorter}
    if "mooncake" in extra:
        raise ConfigError(
            f'{where}["mooncake"] is set, but the format is {fmt!r}; set "format": "mooncake" or remove it'
        )
    path = extra.get("shared_storage_path")
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(
            f'{where}["shared_storage_path"] is {path!r}; expected the directory the per-request files are written to '
            "(a path the client sees too)"
        )
    if not os.path.isabs(path):
        raise ConfigError(
            f'{where}["shared_storage_path"] is {path!r}, a relative path; expected an absolute one: each response names '
            "the file by this path, and a client reads it from its own working directory, not the server's"
        )
    return {"out": path, "format": FORMATS[fmt], **shorter}


def capture_config(vllm_config: Any):
    """The capture ``vllm_config`` asks for (``additional_config``, ``HSCAPTURE_*``, the KV connector), or None."""
    return from_sources(getattr(vllm_config, "additional_config", None), settings(vllm_config))


def destination(cfg: Any) -> dict[str, Any]:
    """Where ``cfg``'s samples go, as the one description the core takes (``_native.Output``; each kind's keys are
    the core's): the KV connector's objects in a Mooncake store (``store``: its client is added where it is opened)
    or per-request files (``staging``), a capture directory (``directory``), or memory (speculators' RPC drivers).
    A new kind of output is one branch here and one variant in ``output/destination.rs``."""
    kind = cfg.per_request.kind if cfg.per_request is not None else None
    if kind == "store":
        return {"kind": "store"}
    if cfg.out is None:
        return {"kind": "memory"}
    files = {"root": cfg.out, "format": cfg.format, "compress": cfg.compress or None, "durable": cfg.durable}
    if kind == "staging":
        return {"kind": "staging", **files, "backlog_mib": staging_backlog_mib(), "collect_s": staging_collect_s()}
    return {"kind": "directory", **files}


def _at_least(name: str, least: int, what: str) -> int:
    """An integer setting of the environment, refused below ``least`` with what it means."""
    v = envs.get(name)
    if v < least:
        raise ConfigError(f"{name}={v} is not valid: expected at least {least} ({what})")
    return v


def staging_backlog_mib() -> int:
    return _at_least("HSCAPTURE_STAGING_BACKLOG_MIB", 0, "MiB of finished samples that may wait for their files")


def max_growing_sample_mib() -> int:
    return _at_least(
        "HSCAPTURE_MAX_GROWING_SAMPLE_MIB", 1, "MiB one request's sample with its generated tokens may take"
    )


def staging_collect_s() -> int:
    return _at_least(
        "HSCAPTURE_STAGING_COLLECT_S",
        10,
        "seconds; speculators' client waits up to 10 s for a file's lock before it reads the file",
    )


def outputs_refused(vllm_config: Any) -> str | None:
    """Why no request may capture its generated tokens (``include_output_tokens``) under this engine's configuration,
    or None. With speculative decoding and asynchronous scheduling, vLLM schedules a step before the previous step's
    draft tokens are verified: the positions the scheduler reports assume every draft accepted, and the model runner
    corrects them on the device, where hscapture does not read. A decode row's position is then unknown where
    hscapture attributes it, so such requests are refused at admission by the workers and the connector alike (the
    same rule: ``_native.Output(outputs_refused=...)``); prompt rows are never drafts, and prompt-only requests run."""
    spec = getattr(vllm_config, "speculative_config", None)
    drafts = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
    sched = getattr(vllm_config, "scheduler_config", None)
    if drafts <= 0 or not bool(getattr(sched, "async_scheduling", False)):
        return None
    method = getattr(spec, "method", None) or "speculative decoding"
    return (
        f"its generated tokens cannot be captured under speculative decoding ({method}, {drafts} draft tokens a step) "
        "with asynchronous scheduling: vLLM schedules each step before the previous step's drafts are verified, so "
        "the positions it reports for a decode step are not the ones the model computes. Start vLLM with "
        "--no-async-scheduling (async_scheduling=False) to capture prompt and response, or ask for the prompt only"
    )
