"""Reading what hscapture wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import _native

_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def load_manifest(out_dir: str | Path) -> dict[str, Any]:
    """``OUT/manifest.json``, checked."""
    return json.loads(_native.read_manifest(str(Path(out_dir) / "manifest.json")))


def load_sample(path: str | Path) -> dict[str, Any]:
    """One sample file as torch tensors: ``hidden_states`` [L, n_layers, H], ``token_ids`` int64 [L]."""
    import torch

    s = _native.read_sample(str(path))
    dtype = getattr(torch, _TORCH_DTYPES[s["dtype"]])
    hs = torch.frombuffer(bytearray(s["data"]), dtype=dtype).reshape(s["shape"])
    return {
        "hidden_states": hs,
        "token_ids": torch.tensor(s["token_ids"], dtype=torch.int64),
        "checksum": s["checksum"],
        "metadata": s["metadata"],
    }
