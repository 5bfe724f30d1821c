"""Capture configuration: vLLM's ``additional_config["hscapture"]`` and ``HSCAPTURE_*`` variables.

A setting may come from either source; given by both with different values it is refused. Layer ids
are validated against the model at start-up (``resolve``), never later.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from . import _native, envs
from .adapters import layer_output
from .errors import ConfigError
from .output import formats

_KEYS = envs.SETTINGS  # additional_config key -> its environment variable
_EXTRA_KEYS = {"model_name"}
_DTYPES = {"auto", *(name for name, _size in _native.dtypes())}


def default_writer_threads() -> int:
    """One writer thread per CPU core, 4 to 16. At the end of a run the last step's samples (512 MiB for
    the Llama-8B shape, 940 MiB for DeepSeek-V3) are written after the last forward; on the H200 host
    (16 cores) 16 threads took that wait from 134 to 29 ms for DeepSeek-V3 (docs/benchmarks.md). In a
    run's steady state the threads mostly wait."""
    import os

    try:
        cores = len(os.sched_getaffinity(0))  # the cores this process may use (affinity, cgroup cpusets)
    except (AttributeError, OSError):
        cores = os.cpu_count() or 4
    return max(4, min(16, cores))


@dataclass(frozen=True)
class PerRequest:
    """The KV connector's output: each request's sample handed to its client, as a file it collects under the
    configuration's ``out`` (``staging``), or, with ``store`` (Mooncake's settings), as an object in that store."""

    store: dict[str, Any] | None = None

    @property
    def kind(self) -> str:
        """The destination kind it is (``adapters/requested.py::destination``)."""
        return "staging" if self.store is None else "store"


@dataclass(frozen=True)
class CaptureConfig:
    """What to capture and where to put it, before the model is known."""

    layers: tuple[int, ...]
    convention: str
    out: str | None = None
    dtype: str = "auto"
    writer_threads: int = field(default_factory=default_writer_threads)
    writer_queue: int = _native.DEFAULTS["writer_queue"]
    durable: bool | str = True  # or _native.DURABLE_WRITEBACK
    on_nonfinite: str = "error"
    compress: int = 0
    format: str = _native.DEFAULTS["format"]
    layer_output: str = "auto"  # adapters/layer_output.py
    model_name: str = ""
    per_request: PerRequest | None = None  # the KV connector's output (connector.py); None: a capture directory
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def resolve(self, num_hidden_layers: int) -> list[int]:
        """The ids validated for this model (sorted); raises ``ConfigError`` naming the problem."""
        return _native.validate_layers(list(self.layers), self.convention, num_hidden_layers)

    def to_additional_config(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "layers": list(self.layers),
            "convention": self.convention,
            "dtype": self.dtype,
            "writer_threads": self.writer_threads,
            "writer_queue": self.writer_queue,
            "durable": self.durable,
            "on_nonfinite": self.on_nonfinite,
            "compress": self.compress,
            "format": self.format,
            "layer_output": self.layer_output,
        }
        if self.out is not None:
            d["out"] = self.out
        if self.model_name:
            d["model_name"] = self.model_name
        return {"hscapture": d}


_INT = re.compile(r"^\s*[+-]?\d+\s*$")  # what a number written as text may look like (not 1_0, not 1.5)


def integer(value: Any) -> int:
    """An int given as an int or as decimal text; anything else (a bool, a float, ``1_0``) is refused."""
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, int):
        return value
    if isinstance(value, str) and _INT.match(value):
        return int(value)
    raise ValueError(value)


def boolean(value: Any) -> bool:
    """A bool given as a bool or as one of true/false, yes/no, on/off, 1/0 (any case); anything else is refused."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        return envs.parse_bool(value)
    raise ValueError(value)


def layer_ids(value: Any) -> tuple[int, ...]:
    """Layer ids as a list of ints or comma-separated text, in ascending order (slot k holds the k-th)."""
    if isinstance(value, str):
        value = [x for x in value.replace(" ", "").split(",") if x]
    if isinstance(value, bool) or not isinstance(value, (list, tuple)) or not value:
        raise ValueError(value)
    ids = tuple(integer(x) for x in value)
    if list(ids) != sorted(ids):
        raise ValueError(f"ascending: {list(ids)}")
    return ids


def _coerce(key: str, value: Any, where: str):
    try:
        if key == "layers":
            return layer_ids(value)
        if key == "compress":
            v, (low, high) = integer(value), _native.COMPRESS_LEVELS
            if v != 0 and not low <= v <= high:
                raise ValueError
            return v
        if key == "writer_threads" and isinstance(value, str) and value.strip().lower() == "auto":
            return default_writer_threads()
        if key in ("writer_threads", "writer_queue"):
            v = integer(value)
            if v < 1:
                raise ValueError
            return v
        if key == "durable":
            return envs.durability(value) if isinstance(value, str) else boolean(value)
        if not isinstance(value, str):
            raise TypeError(value)  # every other setting is text
        if key == "out":
            if not value.strip():
                raise ValueError
            return value
        if key == "on_nonfinite":
            v = value.strip().lower()
            if v not in ("error", "skip"):
                raise ValueError
            return v
        if key == "format":
            try:
                return _native.canonical_format(value.strip().lower())
            except ConfigError:
                raise ValueError(value) from None
        if key == "convention":
            v = value.strip().lower()
            if v not in ("after", "before"):
                raise ValueError
            return v
        if key == "layer_output":
            v = value.strip().lower()
            if v not in layer_output.SETTINGS:
                raise ValueError
            return v
        if key == "dtype":
            v = value.strip().lower().removeprefix("torch.")
            v = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "float": "float32", "half": "float16"}.get(
                v, v
            )
            if v not in _DTYPES:
                raise ValueError
            return v
        return value
    except (TypeError, ValueError):
        expect = {
            "layers": "a non-empty list of integer layer ids in ascending order, such as [2, 4, 5]",
            "out": "the output directory, a non-empty path (leave the key out only with speculators' RPC surface)",
            "durable": f'true or false (also yes/no, on/off, 1/0), or "{_native.DURABLE_WRITEBACK}"',
            "model_name": "the model's name, as text",
            "convention": '"after" or "before"',
            "layer_output": '"auto" (read from each layer\'s forward), "sum" (hidden_states + residual) or "hidden" '
            "(the layer's hidden_states alone)",
            "format": "one of "
            + ", ".join(
                f"{f.name}{' (also ' + ', '.join(f.aliases) + ')' if f.aliases else ''}"
                for f in formats.FORMATS.values()
            ),
            "dtype": "auto, float32, bfloat16 or float16",
            "writer_threads": 'a positive integer or "auto" (one per CPU core, 4 to 16)',
            "writer_queue": "a positive integer",
            "compress": "an integer: 0 (store states as they are) or a zstd level {}..{} (byte-plane split + zstd; 3 is "
            "a good default)".format(*_native.COMPRESS_LEVELS),
            "on_nonfinite": '"error" (default: a NonFiniteError naming sample, layer and count) or "skip" (the sample is '
            "not written and is listed in the manifest)",
        }.get(key, "a string")
        raise ConfigError(f"{where}: {key}={value!r} is not valid; expected {expect}") from None


def from_sources(additional_config: dict | None, connector: dict | None = None) -> CaptureConfig | None:
    """Merges ``additional_config["hscapture"]``, ``HSCAPTURE_*`` and the KV connector's settings
    (``requested.settings``: its output directory, format and shorter spellings); None when none names layers."""
    envs.check_unknown()
    section = (additional_config or {}).get("hscapture")
    if section is not None and not isinstance(section, dict):
        raise ConfigError(f'additional_config["hscapture"] must be a mapping, found {type(section).__name__}')
    section = dict(section or {})
    unknown = set(section) - set(_KEYS) - _EXTRA_KEYS
    if unknown:
        raise ConfigError(
            f'additional_config["hscapture"] has unknown keys {sorted(unknown)}; known keys: {sorted(set(_KEYS) | _EXTRA_KEYS)}'
        )
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    connector = dict(connector or {})
    mooncake = connector.pop("mooncake", None)
    where_kv = 'kv_transfer_config["kv_connector_extra_config"]'
    for key, var in _KEYS.items():
        given = []
        if key in section:
            given.append(("additional_config", _coerce(key, section[key], 'additional_config["hscapture"]')))
        if key in connector:
            given.append(("kv_connector_extra_config", _coerce(key, connector[key], where_kv)))
        if envs.is_set(var):
            given.append((var, _coerce(key, envs.raw(var), var)))
        if len({repr(v) for _, v in given}) > 1:
            said = ", ".join(f"{where} says {v!r}" for where, v in given)
            raise ConfigError(f"{key} is given twice with different values: {said}; remove one of them")
        if given:
            sources[key], values[key] = given[0]
    if "layers" not in values:
        if values.get("out") is not None:
            raise ConfigError(
                "an output directory is set but no layer ids: give `layers` (additional_config) or HSCAPTURE_LAYERS, "
                "with a `convention`"
            )
        return None
    if "convention" not in values:
        raise ConfigError(
            f"layer ids {list(values['layers'])} are given without a convention: set `convention` (or "
            'HSCAPTURE_CONVENTION) to "after" (id i = output of decoder layer i, speculators 0.3/0.4) or "before" '
            "(id i = input of layer i, 0 = embeddings, N = final output before the norm; vLLM, speculators training)"
        )
    defaults = {
        k: _coerce(k, envs.REGISTRY[v].default, v) for k, v in _KEYS.items() if envs.REGISTRY[v].default is not None
    }
    merged = {**defaults, **values}
    per_request = PerRequest(mooncake) if connector or mooncake is not None else None
    if per_request is not None and per_request.kind == "staging" and "durable" not in values:
        # Per-request files are a hand-over, not a dataset: the client reads each one as soon as its lock is free
        # and moves it away (speculators writes its own copy), and a server that dies fails the requests in flight.
        # Atomic renames keep every file whole; an fsync per file and directory would only slow the server down.
        merged["durable"] = False
    if connector and merged.get("on_nonfinite") == "skip":
        raise ConfigError(
            "on_nonfinite=skip with the KV connector: a skipped sample's answer would name a file that never appears; "
            "expected on_nonfinite=error there (a NaN/Inf then fails the request with the error)"
        )
    if mooncake is not None and (merged.get("out") is not None or merged.get("compress")):
        raise ConfigError(
            "the mooncake format stores each sample in the Mooncake store: expected no output directory (`out`) and "
            "no compression; remove them"
        )
    return CaptureConfig(
        model_name=str(section.get("model_name", "")), sources=sources, per_request=per_request, **merged
    )
