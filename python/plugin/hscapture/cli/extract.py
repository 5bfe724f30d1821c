"""``hscapture extract``: prompts in, one file per prompt plus a manifest out.

Drives vLLM's engine (``max_tokens=1``, prompts streamed in, :mod:`.engine`), with ``CaptureWorker`` doing the
capture in every worker process; the writing rank writes the files, this driver the manifest. Optional: the
legacy ``data_{i}.pt`` layout (:mod:`.legacy`), data-parallel shards (:mod:`.shard`), progress (:mod:`.report`).
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
from ..config import CaptureConfig, default_writer_threads
from ..errors import CompatibilityError, ConfigError, OutputError
from ..outlock import OutputLock
from ..patches import apply_driver_shims
from . import legacy
from .engine import drive
from .inputs import as_prompt_set, check_prompts, has_tokenizer, read_model_config, text_config
from .report import ExtractReport, Progress
from .shard import Shard, ShardInfo, check_resume

__all__ = ["ExtractOptions", "ExtractReport", "run_extract", "prepare_out", "quiet_vllm"]
_ELEM = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class ExtractOptions:
    model: str
    prompts: object  # list of token-id lists, or an inputs.PromptSet / arrow.ArrowPrompts
    out: str
    convention: str
    layers: list[int] | None = None
    tp: int = 1
    pp: int = 1
    on_nonfinite: str = "error"
    compress: int = 0
    dtype: str = "auto"
    store_dtype: str = "auto"
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    overwrite: bool = False
    resume: bool = False
    writer_threads: int = field(default_factory=default_writer_threads)
    durable: bool = True
    progress: bool = True  # a bar; False: plain log lines every `log_every` seconds (0: none)
    log_every: float = 0.0
    format: str = "hscapture"  # or "legacy" (speculators 0.3/0.4's data_{i}.pt)
    shard: str | None = None  # "k/n"
    executor: str | None = None  # vLLM's distributed_executor_backend (mp, ray, ...)
    input_path: str = ""
    window: int = 1024
    llm_kwargs: dict = field(default_factory=dict)  # more of vLLM's engine arguments (CLI: --vllm-arg, vllm_args.py)
    compile: bool = False  # vLLM's torch.compile on (enforce_eager off); see vllm_compat.compiled
    trust_remote_code: bool = False  # run the model directory's own code (vLLM's config/model, the tokenizer)


def prepare_out(out: Path, overwrite: bool, resume: bool = False, fmt: str = "hscapture") -> None:
    hs = out / "hidden_states"
    existing = ((out / "manifest.json").exists() or (hs.is_dir() and any(hs.iterdir())) or legacy.holds_capture(out)
                or (out / legacy.STAGING).is_dir())
    if overwrite and resume:
        raise ConfigError("--overwrite and --resume contradict each other: choose one")
    if existing and not (overwrite or resume):
        raise OutputError(
            f"{out} already holds captured states; pass --resume to continue that run (finished samples are kept), "
            "--overwrite to replace them, or choose another --out"
        )
    if existing and overwrite:
        shutil.rmtree(hs, ignore_errors=True)
        legacy.remove(out)
        for f in ("manifest.json", "shard.json", "records.jsonl"):
            (out / f).unlink(missing_ok=True)
    if existing and resume:
        for d in (hs, out / legacy.STAGING / "hidden_states"):
            for f in d.iterdir() if d.is_dir() else []:
                if ".partial-" in f.name:
                    f.unlink(missing_ok=True)  # an interrupted write: never visible as a sample
        legacy.drop_partial(out)
    target = out / legacy.STAGING / "hidden_states" if fmt == "legacy" else hs
    try:
        target.mkdir(parents=True, exist_ok=True)
        probe = target / ".hscapture-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise OutputError(f"cannot write to {target}: {e}; choose a directory you can write") from None


def _check_settings(out: Path, ids: list[int], convention: str, fmt: str) -> None:
    if (out / "manifest.json").exists():
        m = json.loads(_native.read_manifest(str(out / "manifest.json")))
        if m["layer_ids"] != ids or m["convention"] != convention:
            raise ConfigError(
                f"{out} holds layers {m['layer_ids']} ({m['convention']} convention); this run asks for {ids} "
                f"({convention}): resume with the same settings, or use --overwrite / another --out"
            )
    other = "hscapture" if fmt == "legacy" else "legacy"
    has_other = legacy.holds_capture(out) if fmt != "legacy" else (out / "hidden_states").is_dir() and any((out / "hidden_states").iterdir())
    if has_other:
        raise ConfigError(f"{out} holds a capture in the {other} format; this run writes {fmt}: resume with the same "
                          "--format, or use --overwrite / another --out")


def finished_samples(out: Path, prompts, ids: list[int], convention: str, rows: set[int] | None = None,
                     fmt: str = "hscapture") -> dict[int, dict]:
    """Samples a previous run finished (``--resume``): from the files themselves (every one re-read). Each must
    still match its prompt; settings must match this run's."""
    prompts = as_prompt_set(prompts)
    rows = set(range(len(prompts))) if rows is None else rows
    _check_settings(out, ids, convention, fmt)
    if fmt == "legacy":
        found, skipped = legacy.scan_finished(out, rows)
    else:
        found, skipped = _native.scan_finished(str(out))
    for line in skipped:
        print(f"[hscapture] ignoring an unreadable file from the earlier run: {line}", file=sys.stderr)
    done = {}
    for i, (rec, toks) in found.items():
        if i not in rows:
            continue  # another shard's row, or beyond the input: not this run's business (verify reports orphans)
        if toks != prompts[i]:
            raise OutputError(
                f"{out}/{rec['file']} holds tokens that are not prompt {i} of this input: the input changed since "
                "the earlier run; start over with --overwrite or use another --out"
            )
        done[i] = rec
    return done


def _meta_from_files(out: Path, opts: ExtractOptions, records: list[dict], ids: list[int]) -> dict:
    """The manifest's settings when a killed run finished every file but wrote no manifest."""
    n_layers = int(text_config(read_model_config(opts.model))["num_hidden_layers"])
    if opts.format == "legacy":
        hs = legacy.states_of(legacy.load(out / records[0]["file"]))
        return {"layer_ids": ids, "convention": opts.convention, "dtype": str(hs.dtype).replace("torch.", ""),
                "hidden_size": hs.shape[2], "num_hidden_layers": n_layers, "tp_size": opts.tp}
    s = _native.read_sample(str(out / records[0]["file"]))
    file_ids = [int(x) for x in s["metadata"].get("layer_ids", "").split(",") if x]
    return {"layer_ids": file_ids, "convention": s["metadata"].get("convention", opts.convention), "dtype": s["dtype"],
            "hidden_size": s["shape"][2], "num_hidden_layers": n_layers, "tp_size": opts.tp}


def _shutdown(llm) -> None:
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def run_extract(opts: ExtractOptions) -> ExtractReport:
    """Captures ``opts.prompts``; holds ``OUT``'s lock for the whole run (one run per directory)."""
    with OutputLock(Path(opts.out).resolve()):
        return _run_extract(opts)


def _check_final_layer(ids: list[int], convention: str, n_layers: int, why: str) -> None:
    final = n_layers if convention == "before" else n_layers - 1
    if ids[-1] != final:
        raise ConfigError(
            f"{why} reads the last captured layer as the verifier's final hidden state, but the last id is {ids[-1]} "
            f"({convention} convention); expected {final} (the last decoder layer's output, before the final norm) "
            f"as the highest id: add {final} to --layers"
        )


def check_executor(executor: str | None) -> None:
    """``--executor ray`` needs Ray installed and a vLLM platform that runs it (feature-detected: the platform's
    ``ray_device_key``); refused before vLLM starts instead of a dead engine."""
    if executor != "ray":
        return
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError("--executor ray needs the `ray` package on every node (pip install ray); it is not "
                          "installed here") from None
    from vllm.platforms import current_platform

    if not getattr(current_platform, "ray_device_key", ""):
        raise CompatibilityError(
            f"vLLM's {current_platform.device_name} platform does not run the Ray executor (no ray_device_key); use "
            "--executor mp (one node) or run on GPUs"
        )


def _run_extract(opts: ExtractOptions) -> ExtractReport:
    prompts = as_prompt_set(opts.prompts)
    if opts.format not in ("hscapture", "legacy"):
        raise ConfigError(f"--format must be hscapture or legacy, found {opts.format!r}")
    if opts.tp < 1:
        raise ConfigError(f"--tp must be at least 1, found {opts.tp}")
    model_cfg = read_model_config(opts.model)
    n_layers = int(text_config(model_cfg)["num_hidden_layers"])
    layers = opts.layers if opts.layers is not None else _native.default_layers(opts.convention, n_layers)
    ids = list(_native.validate_layers(list(layers), opts.convention, n_layers))
    if opts.format == "legacy":
        _check_final_layer(ids, opts.convention, n_layers, "speculators 0.3/0.4's trainer (--format legacy)")
    elif getattr(prompts, "kind", "") == "arrow":
        _check_final_layer(ids, opts.convention, n_layers, "speculators' training on a prepared dataset")
    check_executor(opts.executor)
    shard = Shard.parse(opts.shard) if opts.shard else None
    rows = shard.rows(len(prompts)) if shard else list(range(len(prompts)))
    check_prompts(prompts, model_cfg, rows)
    out = Path(opts.out).resolve()
    cap_out = out / legacy.STAGING if opts.format == "legacy" else out
    prepare_out(out, opts.overwrite, opts.resume, opts.format)
    failures.clear(cap_out)
    info = ShardInfo(shard.k, shard.n, len(prompts), opts.input_path or getattr(prompts, "source", ""),
                     prompts.fingerprint(), opts.format) if shard else None
    checks: list[str] = [f"layer ids {ids} validated for {n_layers} layers ({opts.convention} convention)"]
    done: dict[int, dict] = {}
    conv = legacy.Converter(out, prompts, opts.durable) if opts.format == "legacy" else None
    if opts.resume:
        check_resume(out, info)
        done = finished_samples(out, prompts, ids, opts.convention, set(rows), opts.format)
        staged = conv.recover(set(rows), done) if conv is not None else 0
        checks.append(f"resume: {len(done)} finished files re-read whole, tokens equal to their prompts, kept"
                      + (f" ({staged} of them converted now from the earlier run's staged files)" if staged else ""))
    if info is not None:
        info.write(out)
    todo = [i for i in rows if i not in done]

    if not todo:
        return _finish(out, opts, prompts, rows, done, None, 0.0, [], ids, checks)
    if opts.pp < 1:
        raise ConfigError(f"--pp must be at least 1, found {opts.pp}")
    runtime_env.apply(opts.tp * opts.pp)
    shims = apply_driver_shims(model_cfg)
    cfg = CaptureConfig(layers=tuple(ids), convention=opts.convention, out=str(cap_out), dtype=opts.store_dtype,
                        writer_threads=opts.writer_threads, durable=opts.durable, model_name=str(opts.model),
                        on_nonfinite=opts.on_nonfinite, compress=opts.compress)

    from vllm import LLM

    longest = max(prompts.length(i) for i in todo)
    kwargs = dict(
        model=str(opts.model),
        tensor_parallel_size=opts.tp,
        pipeline_parallel_size=opts.pp,
        dtype=opts.dtype,
        enforce_eager=not opts.compile,
        enable_prefix_caching=False,
        skip_tokenizer_init=not has_tokenizer(opts.model),
        max_model_len=opts.max_model_len or max(longest + 1, 32),
        worker_cls="hscapture.worker.CaptureWorker",
        additional_config=cfg.to_additional_config(),
        seed=0,
        disable_log_stats=True,
        trust_remote_code=opts.trust_remote_code,
    )
    if opts.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = opts.max_num_batched_tokens
    if opts.executor:
        kwargs["distributed_executor_backend"] = opts.executor
    if opts.progress:
        kwargs["use_tqdm_on_load"] = False  # one progress bar on the terminal: ours (generate's is not used either)
    kwargs.update(opts.llm_kwargs)
    try:
        llm = LLM(**kwargs)
    except Exception as e:
        failures.raise_recorded(cap_out, e)
        raise
    total_tokens = sum(prompts.length(i) for i in todo)
    progress = None
    if opts.progress or opts.log_every > 0:
        progress = Progress(len(todo), total_tokens, _bytes_per_token(model_cfg, opts, len(ids)),
                            interactive=opts.progress, every=opts.log_every or 30.0,
                            label=f"shard {shard}" if shard else "capture")

    def finished(i: int, length: int) -> None:
        if progress is not None:
            progress.update(1, length)
        if conv is not None:
            conv.finished(i)

    try:
        t0 = time.perf_counter()
        drive(llm, prompts, todo, finished, window=opts.window, on_step=conv.poll if conv else None)
        results = [r for r in llm.collective_rpc("hscapture_finish") if r]
        seconds = time.perf_counter() - t0
    except Exception as e:
        failures.raise_recorded(cap_out, e)
        raise
    finally:
        if progress is not None:
            progress.close()
        _shutdown(llm)
    failures.raise_recorded(cap_out)  # a worker failed, yet the engine finished the run (vLLM 0.23 can)
    writers = [r for r in results if r.get("writer")]
    if len(writers) != 1:
        raise OutputError(f"expected one writing rank, {len(writers)} reported; results: {results}")
    w = writers[0]
    stats = w.get("stats", {})
    checks.append(f"contract per step (shapes, dtypes, rows = prompt tokens, finite values): {stats.get('steps', '?')} "
                  f"steps, {stats.get('rows', '?')} rows")
    if opts.tp > 1:
        checks.append(f"each step's checksum equal on all {opts.tp} TP ranks")
    if conv is not None:
        conv.drain([r["index"] for r in w["records"]])
        w = dict(w, records=[conv.records[r["index"]] for r in w["records"]])
        checks.append(f"legacy: {len(w['records'])} files converted from the writer's files (checksums carried over)")
    rep = _finish(out, opts, prompts, rows, done, w, seconds, shims, ids, checks)
    if progress is not None:
        rep.steady_tokens_per_s = progress.steady_rate()
    return rep


def _bytes_per_token(cfg: dict, opts: ExtractOptions, n: int) -> int:
    dt = opts.store_dtype if opts.store_dtype != "auto" else opts.dtype
    if dt == "auto":
        dt = str(text_config(cfg).get("torch_dtype") or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return n * int(text_config(cfg)["hidden_size"]) * _ELEM.get(dt, 2)


def _finish(out: Path, opts: ExtractOptions, prompts, rows: list[int], done: dict, w: dict | None, seconds: float,
            shims: list[str], ids: list[int], checks: list[str]) -> ExtractReport:
    """Checks that every row has its file and writes the manifest (earlier finished samples included)."""
    records = list(done.values()) + (w["records"] if w else [])
    got = {r["index"] for r in records}
    # Samples skipped for NaN/Inf (on_nonfinite=skip): listed in the manifest, retried by --resume.
    skipped = [dict(x, index=int(x["sample"])) for x in (w or {}).get("skipped", []) if str(x["sample"]).isdigit()]
    missing = sorted(set(rows) - got - {x["index"] for x in skipped})
    if missing:
        raise OutputError(
            f"{len(missing)} of {len(rows)} prompts produced no file (first: {missing[:10]}); aborted requests: "
            f"{(w or {}).get('aborted', [])[:5]}; re-run with --resume to capture them"
        )
    import vllm

    prev = json.loads(_native.read_manifest(str(out / "manifest.json"))) if (out / "manifest.json").exists() else {}
    meta = w or prev or _meta_from_files(out, opts, records, ids)
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
    if skipped:
        manifest["skipped"] = [{"index": x["index"], "why": x["why"]} for x in skipped]
    if opts.format == "legacy":
        legacy.write_sidecars(out, records, manifest, model=str(opts.model), input_path=opts.input_path or
                              getattr(prompts, "source", ""), num_samples=len(rows),
                              seq_length=opts.max_model_len or max(r["length"] for r in records) + 1, tp=opts.tp,
                              gpu_memory_utilization=opts.llm_kwargs.get("gpu_memory_utilization"), durable=opts.durable)
        shutil.rmtree(out / legacy.STAGING, ignore_errors=True)
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
        traced_calls=(w or {}).get("traced_calls"),
        resumed=len(done),
        format=opts.format,
        shard=opts.shard,
        checks=checks + [f"manifest: {len(records)} samples, every row {'of shard ' + opts.shard + ' ' if opts.shard else ''}"
                         "has its file; run `hscapture verify` to re-read every file"],
    )


def quiet_vllm() -> None:
    """Keeps vLLM's INFO chatter out of the terminal unless the user asked for it."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
