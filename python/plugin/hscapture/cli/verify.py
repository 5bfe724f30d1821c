"""``hscapture verify DIR [--model PATH]``: every file against the manifest and the contract (shapes,
dtypes, finite values, token ids, checksums, no orphans or partial files); optionally recompute samples
with HF transformers and compare. Both layouts: ``hidden_states/hs_{i}.safetensors`` (checked in Rust) and
the legacy ``data_{i}.pt``."""

from __future__ import annotations

import json
from pathlib import Path

from .. import _native
from . import legacy

TOLERANCE = 1e-3


def _load(root: Path, rec: dict) -> dict:
    from .. import load_sample

    if rec["file"].endswith(".pt"):
        d = legacy.load(root / rec["file"])
        return {"token_ids": d["input_ids"], "hidden_states": legacy.states_of(d)}
    return load_sample(root / rec["file"])


def run_verify(root: Path, model: str | None = None, n: int = 2) -> int:
    is_legacy = legacy.is_legacy(root)
    samples, tokens, nbytes, problems = (legacy.verify_dir if is_legacy else _native.verify_dir)(root if is_legacy else str(root))
    print(f"checked {samples} samples, {tokens} tokens, {nbytes / 2**20:.1f} MiB in {root}"
          + (" (legacy data_{i}.pt layout)" if is_legacy else ""))
    for p in problems[:50]:
        print(f"  PROBLEM {p}")
    if len(problems) > 50:
        print(f"  ... and {len(problems) - 50} more")
    ok = not problems
    if model and samples:
        from .. import reference
        from ..compare import compare

        m = json.loads(_native.read_manifest(str(root / "manifest.json")))
        picked = m["samples"][: max(1, n)]
        loaded = [_load(root, s) for s in picked]
        refs = reference.compute_subprocess(model, [x["token_ids"].tolist() for x in loaded], m["layer_ids"],
                                            m["convention"], root / ".verify-reference")
        cmp = compare([x["hidden_states"] for x in loaded], refs)
        good = cmp.ok(TOLERANCE)
        print(f"  recomputed {len(picked)} samples with HF transformers: worst relative error {cmp.worst:.2e} "
              f"({'PASS' if good else 'FAIL'}, tolerance {TOLERANCE:.0e}; bf16 data needs ~1e-2)")
        ok = ok and good
    print("OK" if ok else "FAILED")
    return 0 if ok else 1
