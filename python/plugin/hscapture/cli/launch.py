"""``hscapture launch``: speculators' ``scripts/launch_vllm.py``, serving through hscapture.

A speculators user starts the server for data generation or online training with

    python scripts/launch_vllm.py MODEL [--hidden-states-backend B] [backend flags] [--target-layer-ids ...] -- VLLM_ARGS

and the one change is the program: ``hscapture launch`` takes the same arguments (the backends and their flags are
hs_connectors' own where it is installed, so ``--hidden-states-path`` and the Mooncake flags mean what they mean
there), chooses the same layer ids, adds the same front-end defaults (``--api-server-count 4``, and
``--renderer-num-workers 2`` where this vLLM has it), keeps vLLM's defaults (compile and CUDA graphs), and starts
``vllm serve`` with hscapture's worker and ``HscaptureConnector`` in the format the backend's connector writes
(``file``, ``fp8``, ``mooncake``), in place of ``--speculative_config extract_hidden_states`` and that connector.
The client side (``generate-offline-data``, ``train --hidden-states-backend ...``) is unchanged."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any

from ..errors import ConfigError

RENDER_DEFAULTS = {"--api-server-count": "4", "--renderer-num-workers": "2"}
"""speculators' front-end defaults, added unless the caller passes the flag (its ``RENDER_THROUGHPUT_DEFAULTS``)."""

FORMAT_OF_CONNECTOR = {
    "ExampleHiddenStatesConnector": "file",
    "FP8HiddenStatesConnector": "fp8",
    "MooncakeHiddenStatesConnector": "mooncake",
}
"""The connector a speculators backend would start, and the hscapture format that writes what it writes."""

WORKER = "hscapture.worker.CaptureWorker"
OWN_FLAGS = ("--worker-cls", "--kv-transfer-config", "--speculative-config")
"""Flags this command sets itself; passed after ``--`` they are refused rather than silently overridden."""


class _FileBackend:
    """speculators' file backend, for a machine without hs_connectors (speculators' launcher vendors the same)."""

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        if "--hidden-states-path" not in parser._option_string_actions:
            parser.add_argument(
                "--hidden-states-path",
                default="/tmp/hidden_states",  # noqa: S108 - speculators' default, kept for the same clients
                help="the directory the per-request files are written to (default /tmp/hidden_states)",
            )

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        extra = {"shared_storage_path": args.hidden_states_path}
        return {"kv_connector": "ExampleHiddenStatesConnector", "kv_connector_extra_config": extra}


class _FP8Backend(_FileBackend):
    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        extra = {"shared_storage_path": args.hidden_states_path}
        return {"kv_connector": "FP8HiddenStatesConnector", "kv_connector_extra_config": extra}


def backends() -> dict[str, Any]:
    """hs_connectors' registered backends where it is installed (their flags and connector settings), else the
    file and fp8 backends spelled as speculators spells them."""
    try:
        from hs_connectors import HiddenStatesBackend
    except ImportError:
        return {"file": _FileBackend, "fp8": _FP8Backend}
    return dict(HiddenStatesBackend.registry)


def parser(registry: dict[str, Any]) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="hscapture launch",
        description="Start `vllm serve` for speculators' data generation and training, capturing with hscapture "
        "(the arguments of speculators' scripts/launch_vllm.py; vLLM's own after --)",
    )
    ap.add_argument("model", help="the model to serve (a path or a hub name, as vllm serve takes it)")
    ap.add_argument("--hidden-states-backend", choices=sorted(registry), default="file")
    for backend in registry.values():
        backend.add_launch_args(ap)
    ap.add_argument(
        "--target-layer-ids",
        type=int,
        nargs="+",
        help="vLLM's layer ids (default [2, L // 2, L - 3, L] for a model of L layers); pass the same to training",
    )
    ap.add_argument(
        "--include-last-layer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="append the last layer (L) to --target-layer-ids (default: on)",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the command without running it")
    ap.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code to read its config")
    return ap


def layer_ids(num_hidden_layers: int, target: list[int] | None, include_last: bool) -> list[int]:
    """speculators' choice of layer ids, checked: the final state (id L) is appended unless asked not to."""
    if target:
        ids = list(target)
        if include_last and num_hidden_layers not in ids:
            ids.append(num_hidden_layers)
    else:
        ids = [2, num_hidden_layers // 2, num_hidden_layers - 3, num_hidden_layers]
    if min(ids) < 0 or max(ids) > num_hidden_layers or len(set(ids)) != len(ids):
        raise ConfigError(
            f"--target-layer-ids {ids}: expected distinct ids within [0, {num_hidden_layers}] (vLLM's ids: id i is the "
            f"input of layer i, {num_hidden_layers} the final state); found ids out of range or repeated"
        )
    return ids


def num_hidden_layers(model: str, trust_remote_code: bool) -> int:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"reading {model!r}'s config to choose layer ids: {e}; expected a model vllm serve can load"
        ) from e
    config = getattr(config, "text_config", None) or config
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"{model!r}'s config has num_hidden_layers {n!r}; expected a positive integer")
    return n


def kv_transfer_config(theirs: dict[str, Any], layers: list[int]) -> dict[str, Any]:
    """hscapture's connector in place of the backend's, writing what that one writes, to the same place."""
    name = theirs.get("kv_connector")
    fmt = FORMAT_OF_CONNECTOR.get(str(name))
    if fmt is None:
        raise ConfigError(
            f"the hidden-states backend starts the connector {name!r}; hscapture serves "
            f"{', '.join(FORMAT_OF_CONNECTOR)} in its place. Choose a backend that uses one of them"
        )
    extra = dict(theirs.get("kv_connector_extra_config") or {})
    if "shared_storage_path" in extra:  # every response names its file by this path: the client needs it whole
        extra["shared_storage_path"] = os.path.abspath(str(extra["shared_storage_path"]))
    extra.update(format=fmt, layers=layers, convention="before")
    return {
        "kv_connector": "HscaptureConnector",
        "kv_connector_module_path": "hscapture.connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": extra,
    }


def _given(flag: str, args: list[str]) -> bool:
    """Whether ``args`` set ``flag`` in any spelling vLLM's parser takes (dashes or underscores, ``=value``)."""
    names = {flag, "--" + flag[2:].replace("-", "_")}
    return any(a == n or a.startswith(n + "=") for a in args for n in names)


def renderer_workers_supported() -> bool:
    """Whether this vLLM has ``--renderer-num-workers`` (newer releases only): a feature, not a version."""
    import dataclasses

    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError as e:
        raise ConfigError(f"vLLM is not importable in this Python ({e}); expected it installed beside hscapture") from e

    return any(f.name == "renderer_num_workers" for f in dataclasses.fields(EngineArgs))


def command(model: str, kv: dict[str, Any], vllm_args: list[str], renderer_workers: bool) -> list[str]:
    for flag in OWN_FLAGS:
        if _given(flag, vllm_args):
            raise ConfigError(
                f"{flag} was passed after --, but hscapture launch sets it itself (hscapture's worker and connector, "
                "no extract_hidden_states); remove it, or run vllm serve yourself (docs/operations.md)"
            )
    defaults: list[str] = []
    for flag, value in RENDER_DEFAULTS.items():
        if flag == "--renderer-num-workers" and not renderer_workers:
            continue
        if not _given(flag, vllm_args):
            defaults += [flag, value]
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        model,
        "--worker-cls",
        WORKER,
        "--kv-transfer-config",
        json.dumps(kv),
        *defaults,
        *vllm_args,
    ]


def main(argv: list[str]) -> int:
    registry = backends()
    args, vllm_args = parser(registry).parse_known_args(argv)
    if "--" in vllm_args:
        vllm_args.remove("--")
    layers = layer_ids(
        num_hidden_layers(args.model, args.trust_remote_code), args.target_layer_ids, args.include_last_layer
    )
    kv = kv_transfer_config(registry[args.hidden_states_backend].build_kv_transfer_config(args), layers)
    cmd = command(args.model, kv, vllm_args, renderer_workers_supported())
    print("Running command:")
    print(shlex.join(cmd), flush=True)
    if not args.dry_run:
        os.execvp(cmd[0], cmd)  # noqa: S606 - the server replaces this process, as speculators' launcher does
    return 0
