"""Reading what hscapture wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .. import _native


def load_manifest(out_dir: str | Path) -> dict[str, Any]:
    """``OUT/manifest.json``, checked."""
    return json.loads(_native.read_manifest(str(Path(out_dir) / _native.MANIFEST)))


def load_sample(path: str | Path) -> dict[str, Any]:
    """One sample file of any format as torch tensors: ``hidden_states`` [L, n_layers, H], ``token_ids`` int64
    [L]; ``loss_mask`` int64 [L] where the format stores one (else None); the file's ``checksum`` and
    ``metadata``; ``stored``, the dtype on disk. Compressed states are decoded, fp8 states dequantized to bfloat16
    as speculators' ``FP8Transfer`` does (after their scales are checked finite and positive)."""
    import torch

    s = _native.read_sample(str(path))
    hs = torch.frombuffer(bytearray(s["data"]), dtype=getattr(torch, s["dtype"])).reshape(s["shape"])
    mask = s["loss_mask"]
    return {
        "hidden_states": hs,
        "token_ids": torch.tensor(s["token_ids"], dtype=torch.int64),
        "loss_mask": torch.tensor(list(mask), dtype=torch.int64) if mask is not None else None,
        "checksum": s["checksum"],
        "metadata": s["metadata"],
        "stored": s["stored"],
    }
