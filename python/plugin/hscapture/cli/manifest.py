"""The end of an extraction: every row has its file (or is listed as skipped), the manifest and the format's
documents are written, and the report says what was captured and checked."""

from __future__ import annotations

import json

from .. import _native
from ..errors import OutputError
from ..output.formats import RunInfo
from .report import ExtractReport
from .run import Run

# The capture's identity as the core writes it (its journal's first line, a finish result's keys).
_IDENTITY = ("format", "model", "layer_ids", "convention", "dtype", "hidden_size", "num_hidden_layers", "layer_output")


def finish(run: Run, w: dict | None, seconds: float, shims: list[str]) -> ExtractReport:
    """Checks that every row has its file and writes the manifest (earlier finished samples included)."""
    opts, fmt, out, rows, done = run.opts, run.fmt, run.out, run.rows, run.done
    records = list(done.values()) + (w["records"] if w else [])
    # Samples skipped for NaN/Inf (on_nonfinite=skip): listed in the manifest, retried by --resume.
    skipped = [dict(x, index=int(x["sample"])) for x in (w or {}).get("skipped", []) if str(x["sample"]).isdigit()]
    missing = sorted(set(rows) - {r["index"] for r in records} - {x["index"] for x in skipped})
    if missing:
        raise OutputError(
            f"{len(missing)} of {len(rows)} prompts produced no file (first: {missing[:10]}); aborted requests: "
            f"{(w or {}).get('aborted', [])[:5]}; re-run with --resume to capture them"
        )
    import vllm

    meta = w or run.found_identity
    # The values are the run's; the schema is the core's (Manifest::of).
    manifest = json.loads(
        _native.new_manifest(
            json.dumps({k: meta[k] for k in _IDENTITY if k in meta}),
            str(opts.model),
            meta.get("model_dtype") or None,
            int(meta.get("tp_size", opts.tp)),
            {"hscapture": _native.__version__, "vllm": str(getattr(vllm, "__version__", "?"))},
            json.dumps(records),
            [(x["index"], x["why"]) for x in skipped],
        )
    )
    fmt.write_documents(
        out,
        records,
        manifest,
        RunInfo(
            model=str(opts.model),
            input_path=opts.input_path or getattr(run.prompts, "source", ""),
            num_samples=len(rows),
            seq_length=opts.max_model_len or max(r["length"] for r in records) + 1,
            tp=opts.tp,
            gpu_memory_utilization=opts.llm_kwargs.get("gpu_memory_utilization"),
            durable=opts.durable,
        ),
    )
    _native.write_manifest(str(out / _native.MANIFEST), json.dumps(manifest))
    new = w["records"] if w else []
    return ExtractReport(
        out=str(out),
        samples=len(new),
        tokens=sum(r["length"] for r in new),
        bytes=sum(r["bytes"] for r in new),
        seconds=seconds,
        layer_ids=list(manifest["layer_ids"]),
        convention=manifest["convention"],
        dtype=manifest["dtype"],
        shims=shims,
        device_path=(w or {}).get("device_path", "none"),
        traced_calls=(w or {}).get("traced_calls"),
        resumed=len(done),
        format=fmt.name,
        shard=opts.shard,
        skipped=len(skipped),
        compressed=bool(opts.compress),
        checks=run.checks
        + [
            f"manifest: {len(records)} samples, every row {'of shard ' + opts.shard + ' ' if opts.shard else ''}"
            f"has its file{f' or is listed as skipped ({len(skipped)})' if skipped else ''}; run "
            "`hscapture verify` to re-read every file"
        ],
    )
