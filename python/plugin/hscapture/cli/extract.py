"""``hscapture extract``: prompts in, one safetensors file per prompt plus a manifest out.

Drives vLLM through its public ``LLM`` API (``max_tokens=1``), with ``CaptureWorker`` doing the
capture in every worker process; the writing rank writes the files, this driver the manifest.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import _native, failures, runtime_env
from ..outlock import OutputLock
from ..config import CaptureConfig
from ..errors import ConfigError, OutputError
from ..patches import apply_driver_shims
from ..vllm_compat import SAMPLE_KEY
from .inputs import check_prompts, has_tokenizer, read_model_config, text_config


@dataclass
class ExtractOptions:
    model: str
    prompts: list[list[int]]
    out: str
    convention: str
    layers: list[int] | None = None
    tp: int = 1
    dtype: str = "auto"
    store_dtype: str = "auto"
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    overwrite: bool = False
    resume: bool = False
    writer_threads: int = 2
    durable: bool = True
    progress: bool = True
    llm_kwargs: dict = field(default_factory=dict)


@dataclass
class ExtractReport:
    out: str
    samples: int
    tokens: int
    bytes: int
    seconds: float
    layer_ids: list[int]
    convention: str
    dtype: str
    shims: list[str]
    device_path: str = "none"
    resumed: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def lines(self) -> list[str]:
        return [
            f"samples     {self.samples}" + (f" (+{self.resumed} finished earlier, kept)" if self.resumed else ""),
            f"tokens      {self.tokens}",
            f"bytes       {self.bytes} ({self.bytes / 2**20:.1f} MiB)",
            f"throughput  {self.tokens_per_s:,.0f} tokens/s ({self.seconds:.1f} s capture)",
            f"layers      {self.layer_ids} ({self.convention} convention), {self.dtype}",
            f"output      {self.out}/hidden_states/hs_{{i}}.safetensors + manifest.json",
        ]


def prepare_out(out: Path, overwrite: bool, resume: bool = False) -> None:
    hs = out / "hidden_states"
    existing = (out / "manifest.json").exists() or (hs.is_dir() and any(hs.iterdir()))
    if overwrite and resume:
        raise ConfigError("--overwrite and --resume contradict each other: choose one")
    if existing and not (overwrite or resume):
        raise OutputError(
            f"{out} already holds captured states; pass --resume to continue that run (finished samples are kept), "
            "--overwrite to replace them, or choose another --out"
        )
    if existing and overwrite:
        shutil.rmtree(hs, ignore_errors=True)
        (out / "manifest.json").unlink(missing_ok=True)
    if existing and resume and hs.is_dir():
        for f in hs.iterdir():
            if ".partial-" in f.name:
                f.unlink(missing_ok=True)  # an interrupted write: never visible as a sample
    try:
        hs.mkdir(parents=True, exist_ok=True)
        probe = hs / ".hscapture-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise OutputError(f"cannot write to {hs}: {e}; choose a directory you can write") from None


def finished_samples(out: Path, prompts: list[list[int]], ids: list[int], convention: str) -> dict[int, dict]:
    """Samples a previous run finished (``--resume``): from its manifest if it wrote one, else from the files
    themselves. Each must still match its prompt; settings must match this run's."""
    if (out / "manifest.json").exists():
        m = json.loads(_native.read_manifest(str(out / "manifest.json")))
        if m["layer_ids"] != ids or m["convention"] != convention:
            raise ConfigError(
                f"{out} holds layers {m['layer_ids']} ({m['convention']} convention); this run asks for {ids} "
                f"({convention}): resume with the same settings, or use --overwrite / another --out"
            )
    found, skipped = _native.scan_finished(str(out))
    for line in skipped:
        print(f"[hscapture] ignoring an unreadable file from the earlier run: {line}", file=sys.stderr)
    done = {}
    for i, (rec, toks) in found.items():
        if i >= len(prompts) or toks != prompts[i]:
            raise OutputError(
                f"{out}/{rec['file']} holds tokens that are not prompt {i} of this input: the input changed since "
                "the earlier run; start over with --overwrite or use another --out"
            )
        done[i] = rec
    return done


def _meta_from_files(out: Path, opts: ExtractOptions, records: list[dict]) -> dict:
    """The manifest's settings when a killed run finished every file but wrote no manifest."""
    s = _native.read_sample(str(out / records[0]["file"]))
    ids = [int(x) for x in s["metadata"].get("layer_ids", "").split(",") if x]
    n_layers = int(text_config(read_model_config(opts.model))["num_hidden_layers"])
    return {"layer_ids": ids, "convention": s["metadata"].get("convention", opts.convention), "dtype": s["dtype"],
            "hidden_size": s["shape"][2], "num_hidden_layers": n_layers, "tp_size": opts.tp}


def _shutdown(llm) -> None:
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def run_extract(opts: ExtractOptions) -> ExtractReport:
    """Captures ``opts.prompts``; holds ``OUT``'s lock for the whole run (one run per directory)."""
    with OutputLock(Path(opts.out).resolve()):
        return _run_extract(opts)


def _run_extract(opts: ExtractOptions) -> ExtractReport:
    model_cfg = read_model_config(opts.model)
    n_layers = int(text_config(model_cfg)["num_hidden_layers"])
    layers = opts.layers if opts.layers is not None else _native.default_layers(opts.convention, n_layers)
    ids = _native.validate_layers(list(layers), opts.convention, n_layers)
    check_prompts(opts.prompts, model_cfg)
    out = Path(opts.out).resolve()
    prepare_out(out, opts.overwrite, opts.resume)
    failures.clear(out)
    done = finished_samples(out, opts.prompts, list(ids), opts.convention) if opts.resume else {}
    todo = [i for i in range(len(opts.prompts)) if i not in done]
    if opts.tp < 1:
        raise ConfigError(f"--tp must be at least 1, found {opts.tp}")

    if not todo:
        return _finish(out, opts, done, [], None, 0.0, [])
    runtime_env.apply(opts.tp)
    shims = apply_driver_shims(model_cfg)
    cfg = CaptureConfig(layers=tuple(ids), convention=opts.convention, out=str(out), dtype=opts.store_dtype,
                        writer_threads=opts.writer_threads, durable=opts.durable, model_name=str(opts.model))

    from vllm import LLM, SamplingParams

    longest = max(len(p) for p in opts.prompts)
    kwargs = dict(
        model=str(opts.model),
        tensor_parallel_size=opts.tp,
        dtype=opts.dtype,
        enforce_eager=True,
        enable_prefix_caching=False,
        skip_tokenizer_init=not has_tokenizer(opts.model),
        max_model_len=opts.max_model_len or max(longest + 1, 32),
        worker_cls="hscapture.worker.CaptureWorker",
        additional_config=cfg.to_additional_config(),
        seed=0,
        disable_log_stats=True,
    )
    if opts.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = opts.max_num_batched_tokens
    kwargs.update(opts.llm_kwargs)
    try:
        llm = LLM(**kwargs)
    except Exception as e:
        failures.raise_recorded(out, e)
        raise
    try:
        params = [SamplingParams(max_tokens=1, detokenize=False, extra_args={SAMPLE_KEY: i}) for i in todo]
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": opts.prompts[i]} for i in todo], params, use_tqdm=opts.progress)
        results = [r for r in llm.collective_rpc("hscapture_finish") if r]
        seconds = time.perf_counter() - t0
    except Exception as e:
        failures.raise_recorded(out, e)
        raise
    finally:
        _shutdown(llm)
    writers = [r for r in results if r.get("writer")]
    if len(writers) != 1:
        raise OutputError(f"expected one writing rank, {len(writers)} reported; results: {results}")
    return _finish(out, opts, done, todo, writers[0], seconds, shims)


def _finish(out: Path, opts: ExtractOptions, done: dict, todo: list[int], w: dict | None, seconds: float,
            shims: list[str]) -> ExtractReport:
    """Checks that every prompt has its file and writes the manifest (earlier finished samples included)."""
    records = list(done.values()) + (w["records"] if w else [])
    got = {r["index"] for r in records}
    missing = sorted(set(range(len(opts.prompts))) - got)
    if missing:
        raise OutputError(
            f"{len(missing)} of {len(opts.prompts)} prompts produced no file (first: {missing[:10]}); aborted requests: "
            f"{(w or {}).get('aborted', [])[:5]}; re-run with --resume to capture them"
        )
    import vllm

    prev = json.loads(_native.read_manifest(str(out / "manifest.json"))) if (out / "manifest.json").exists() else {}
    meta = w or prev or _meta_from_files(out, opts, records)
    manifest = {
        "format": "hscapture/1",
        "model": str(opts.model),
        "layer_ids": meta["layer_ids"],
        "convention": meta["convention"],
        "dtype": meta["dtype"],
        "hidden_size": meta["hidden_size"],
        "num_hidden_layers": meta["num_hidden_layers"],
        "tensor_parallel_size": meta.get("tp_size", meta.get("tensor_parallel_size", opts.tp)),
        "created_by": {"hscapture": _native.__version__, "vllm": getattr(vllm, "__version__", "?")},
        "samples": records,
    }
    _native.write_manifest(str(out / "manifest.json"), json.dumps(manifest))
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
        resumed=len(done),
    )


def quiet_vllm() -> None:
    """Keeps vLLM's INFO chatter out of the terminal unless the user asked for it."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
