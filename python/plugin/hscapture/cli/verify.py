"""``hscapture verify DIR [--model PATH]``: every file against the manifest and the contract (shapes, dtypes,
finite values, token ids, whole-file checksums, no orphans or partial files), whatever the format (checked in
Rust), and the format's documents; optionally recompute samples with HF transformers and compare."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from .. import _native, load_sample
from ..output import formats

# Worst relative error against the float32 reference that each dtype's rounding (and a model computed in it) leaves.
TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 3e-2}


def tolerance(manifest: dict) -> float:
    """What the comparison allows: the coarser of the stored dtype and the dtype vLLM ran the model in."""
    dtypes = [manifest["dtype"], manifest.get("model_dtype") or manifest["dtype"]]
    return max(TOLERANCE.get(d, 3e-2) for d in dtypes)


def run_verify(root: Path, model: str | None = None, n: int = 2, tol: float | None = None) -> int:
    samples, tokens, nbytes, problems = _native.verify_dir(str(root))
    m = json.loads(_native.read_manifest(str(root / _native.MANIFEST)))
    fmt = formats.of_manifest(m)
    problems += fmt.check_documents(root, m)
    print(
        f"checked {samples} samples, {tokens} tokens, {nbytes / 2**20:.1f} MiB in {root} ({fmt.name} format: "
        f"{fmt.file_pattern})"
    )
    for p in problems[:50]:
        print(f"  PROBLEM {p}")
    if len(problems) > 50:
        print(f"  ... and {len(problems) - 50} more")
    ok = not problems
    if model and samples:
        from ..testing import reference
        from ..testing.compare import compare

        picked = m["samples"][: max(1, n)]
        loaded = [load_sample(root / s["file"]) for s in picked]
        work = Path(tempfile.mkdtemp(prefix="hscapture-verify-"))
        try:
            refs = reference.compute_subprocess(
                model, [x["token_ids"].tolist() for x in loaded], m["layer_ids"], m["convention"], work
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)
        cmp = compare([x["hidden_states"] for x in loaded], refs)
        limit = tol if tol is not None else tolerance(m)
        good = cmp.ok(limit)
        print(
            f"  recomputed {len(picked)} samples with HF transformers: worst relative error {cmp.worst:.2e} "
            f"({'PASS' if good else 'FAIL'}, tolerance {limit:.0e}"
            + (
                ")"
                if tol is not None
                else f" for {m['dtype']} states of a {m.get('model_dtype') or m['dtype']} model; --tolerance sets another)"
            )
        )
        ok = ok and good
    print("OK" if ok else "FAILED")
    return 0 if ok else 1
