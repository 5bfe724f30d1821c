"""``hscapture extract``: prompts in, one file per prompt plus a manifest out.

Drives vLLM's engine (``max_tokens=1``, prompts streamed in, :mod:`.engine`), with ``CaptureWorker`` doing the
capture in every worker process; the writing rank writes the files in the chosen format, this driver the
manifest and the format's documents. Everything the run needs is checked before vLLM starts; ``--overwrite``
moves the earlier capture aside (:mod:`.outdir`) and removes it only once the engine has started; ``--resume``
keeps exactly the files the earlier run's ledger vouches for (``resume.rs``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import _native, lifetime, runtime_env
from ..adapters.vllm_compat import LOSS_MASK_KEY, SAMPLE_KEY
from ..config import CaptureConfig, default_writer_threads
from ..errors import CompatibilityError, ConfigError, OutputError
from ..output import failures, formats
from ..output.outlock import OutputLock
from ..patches import apply_driver_shims
from . import outdir
from .engine import drive
from .inputs import as_prompt_set, check_prompts, has_tokenizer, model_field, read_model_config
from .manifest import finish
from .report import ExtractReport, Progress
from .run import Run
from .shard import Shard, ShardInfo, check_resume

__all__ = ["ExtractOptions", "ExtractReport", "run_extract", "prepare_out", "quiet_vllm"]
prepare_out = outdir.prepare


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
    layer_output: str = "auto"  # adapters/layer_output.py
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
    format: str = _native.DEFAULTS["format"]  # formats.FORMATS
    shard: str | None = None  # "k/n"
    executor: str | None = None  # vLLM's distributed_executor_backend (mp, ray, ...)
    input_path: str = ""
    window: int = 1024
    llm_kwargs: dict = field(default_factory=dict)  # more of vLLM's engine arguments (CLI: --vllm-arg, vllm_args.py)
    compile: bool = False  # vLLM's torch.compile on (enforce_eager off); see vllm_compat.compiled
    trust_remote_code: bool = False  # run the model directory's own code (vLLM's config/model, the tokenizer)


def run_extract(opts: ExtractOptions) -> ExtractReport:
    """Captures ``opts.prompts``; holds ``OUT``'s lock for the whole run (one run per directory)."""
    check_options(opts)
    with OutputLock(Path(opts.out).resolve()):
        return _run_extract(opts)


def check_options(opts: ExtractOptions) -> None:
    """Every option's range, with the flag the user wrote, before anything is read or started."""
    formats.get(opts.format)
    for flag, value, low in (
        ("--tp", opts.tp, 1),
        ("--pp", opts.pp, 1),
        ("--writer-threads", opts.writer_threads, 1),
        ("--max-num-batched-tokens", opts.max_num_batched_tokens, 1),
        ("--max-model-len", opts.max_model_len, 2),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ConfigError(f"{flag} must be an integer of at least {low}, found {value!r}")
    low, high = _native.COMPRESS_LEVELS
    if (
        isinstance(opts.compress, bool)
        or not isinstance(opts.compress, int)
        or not (opts.compress == 0 or low <= opts.compress <= high)
    ):
        raise ConfigError(f"--compress must be 0 (none) or a zstd level {low}..{high}, found {opts.compress!r}")
    if opts.compress and not formats.get(opts.format).compressible:
        raise ConfigError(
            f"--compress applies to --format hscapture; the {opts.format} format stores states as they are"
        )
    if opts.overwrite and opts.resume:
        raise ConfigError("--overwrite and --resume contradict each other: choose one")


def _check_final_layer(ids: list[int], convention: str, n_layers: int, why: str) -> None:
    final = _native.final_layer_id(convention, n_layers)
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
        raise ConfigError(
            "--executor ray needs the `ray` package on every node (pip install ray); it is not installed here"
        ) from None
    from vllm.platforms import current_platform

    if not getattr(current_platform, "ray_device_key", ""):
        raise CompatibilityError(
            f"vLLM's {current_platform.device_name} platform does not run the Ray executor (no ray_device_key); use "
            "--executor mp (one node) or run on GPUs"
        )


def identity(opts: ExtractOptions, ids: list[int], cfg: dict) -> dict:
    """The run's identity as far as the driver knows it (the stored dtype may be vLLM's choice: `auto`)."""
    dtype = opts.store_dtype if opts.store_dtype != "auto" else opts.dtype
    hidden, layers = model_field(cfg, "hidden_size"), model_field(cfg, "num_hidden_layers")
    return dict(_native.capture_identity(opts.format, str(opts.model), ids, opts.convention, dtype, hidden, layers))


def _run_extract(opts: ExtractOptions) -> ExtractReport:
    prompts = as_prompt_set(opts.prompts)
    fmt = formats.get(opts.format)
    model_cfg = read_model_config(opts.model)
    n_layers = model_field(model_cfg, "num_hidden_layers")
    layers = opts.layers if opts.layers is not None else _native.default_layers(opts.convention, n_layers)
    ids = list(_native.validate_layers(list(layers), opts.convention, n_layers))
    if fmt.final_layer_reader:
        _check_final_layer(ids, opts.convention, n_layers, fmt.final_layer_reader)
    elif getattr(prompts, "kind", "") == "arrow":
        _check_final_layer(ids, opts.convention, n_layers, "speculators' training on a prepared dataset")
    check_executor(opts.executor)
    shard = Shard.parse(opts.shard) if opts.shard else None
    rows = shard.rows(len(prompts)) if shard else list(range(len(prompts)))
    check_prompts(prompts, model_cfg, rows, opts.max_model_len)
    out = Path(opts.out).resolve()
    checks = [f"layer ids {ids} validated for {n_layers} layers ({opts.convention} convention)"]
    run = Run(opts, prompts, fmt, model_cfg, ids, rows, out, checks)
    aside = outdir.prepare(out, opts.overwrite, opts.resume, fmt)
    try:
        failures.clear(out)
        info = _shard_info(run, shard) if shard else None
        if opts.resume:
            check_resume(out, info)
            run.done, run.found_identity = _resume(out, prompts, set(rows), identity(opts, ids, model_cfg))
            checks.append(
                f"resume: {len(run.done)} finished files kept, each re-read whole with the checksum its record "
                "vouches for, the run's settings and tokens equal to their prompts"
            )
        if info is not None:
            info.write(out)
        if not run.todo:
            outdir.discard(aside)
            return finish(run, None, 0.0, [])
        return _capture(run, aside)
    except BaseException:
        outdir.restore(out, aside)  # nothing was started: the earlier capture comes back
        raise


def _shard_info(run: Run, shard: Shard) -> ShardInfo:
    source = run.opts.input_path or getattr(run.prompts, "source", "")
    return ShardInfo(shard.k, shard.n, len(run.prompts), source, run.prompts.fingerprint(), run.fmt.name)


def _resume(out: Path, prompts, rows: set[int], ident: dict) -> tuple[dict[int, dict], dict | None]:
    """Samples a previous run finished, as its ledger proves them; each must still be its input line."""
    kept, recapture, found = _native.resume_plan(str(out), json.dumps(ident))
    for line in recapture:
        print(f"[hscapture] resume: {line}", file=sys.stderr)
    beyond = sorted(i for i in kept if i not in rows and i >= len(prompts))
    if beyond:
        raise ConfigError(
            f"{out} holds finished samples {beyond[:10]} beyond this input's {len(prompts)} rows: the input changed since "
            "the earlier run (it was cut short?); resume with the same input, or use --overwrite / another --out"
        )
    done = {}
    for i, (rec, toks) in kept.items():
        if i not in rows:
            continue  # another shard's row: not this run's business (verify reports orphans)
        if toks != prompts[i]:
            raise OutputError(
                f"{out}/{rec['file']} holds tokens that are not prompt {i} of this input: the input changed since "
                "the earlier run; start over with --overwrite or use another --out"
            )
        done[i] = rec
    return done, json.loads(found) if found else None


def _engine_kwargs(run: Run) -> dict:
    """vllm.LLM's arguments: hscapture's worker and capture settings, then the user's `--vllm-arg`s."""
    opts = run.opts
    cfg = CaptureConfig(
        layers=tuple(run.ids),
        convention=opts.convention,
        out=str(run.out),
        dtype=opts.store_dtype,
        writer_threads=opts.writer_threads,
        durable=opts.durable,
        model_name=str(opts.model),
        on_nonfinite=opts.on_nonfinite,
        layer_output=opts.layer_output,
        compress=opts.compress,
        format=run.fmt.name,
    )
    longest = max(run.prompts.length(i) for i in run.todo)
    max_pos = model_field(run.model_cfg, "max_position_embeddings", required=False)
    auto_len = max(longest + 1, 32)  # a prompt and its one generated token; check_prompts kept it under max_pos
    if max_pos is not None:
        auto_len = min(auto_len, max_pos)
    kwargs = dict(
        model=str(opts.model),
        tensor_parallel_size=opts.tp,
        pipeline_parallel_size=opts.pp,
        dtype=opts.dtype,
        enforce_eager=not opts.compile,
        enable_prefix_caching=False,
        skip_tokenizer_init=not has_tokenizer(opts.model),
        max_model_len=opts.max_model_len or auto_len,
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
    return kwargs


def _capture(run: Run, aside) -> ExtractReport:
    """Starts vLLM with the capture, streams the rows still to do through it, and writes the manifest."""
    opts = run.opts
    runtime_env.apply(opts.tp * opts.pp)
    shims = apply_driver_shims(run.model_cfg)
    kwargs = _engine_kwargs(run)
    from vllm import LLM

    os.environ[lifetime.MARK] = str(os.getpid())  # the processes vLLM starts now die with this one
    try:
        llm = LLM(**kwargs)
    except Exception as e:
        failures.raise_recorded(run.out, e)
        raise
    outdir.discard(aside)  # the engine started with the capture set up: the replaced capture goes now
    progress = _progress(run, llm)
    try:
        t0 = time.perf_counter()
        with lifetime.Watchdog(lifetime.engine_processes(llm)):
            finished = (lambda i, length: progress.update(1, length)) if progress else (lambda i, length: None)
            drive(llm, run.prompts, run.todo, finished, window=opts.window, extra_args=lambda i: _sample_args(run, i))
            results = [r for r in llm.collective_rpc("hscapture_finish") if r]
        seconds = time.perf_counter() - t0
    except Exception as e:  # a worker's recorded error is the root cause of a dead engine: it comes first
        failures.raise_recorded(run.out, e)
        raise
    finally:
        if progress is not None:
            progress.close()
        _shutdown(llm)
    failures.raise_recorded(run.out)  # a worker failed, yet the engine finished the run (vLLM 0.23 can)
    writers = [r for r in results if r.get("writer")]
    if len(writers) != 1:
        raise OutputError(f"expected one writing rank, {len(writers)} reported; results: {results}")
    w = writers[0]
    stats = w.get("stats", {})
    run.checks.append(
        f"contract per step (shapes, dtypes, rows = prompt tokens, finite values): {stats.get('steps', '?')} "
        f"steps, {stats.get('rows', '?')} rows"
    )
    if opts.tp > 1:
        run.checks.append(f"each step's checksum equal on all {opts.tp} TP ranks")
    rep = finish(run, w, seconds, shims)
    if progress is not None:
        rep.steady_tokens_per_s = progress.steady_rate()
    return rep


def _progress(run: Run, llm) -> Progress | None:
    opts = run.opts
    if not (opts.progress or opts.log_every > 0):
        return None
    return Progress(
        len(run.todo),
        sum(run.prompts.length(i) for i in run.todo),
        _bytes_per_token(llm, run.model_cfg, opts, len(run.ids)),
        interactive=opts.progress,
        every=opts.log_every or 30.0,
        label=f"shard {opts.shard}" if opts.shard else "capture",
    )


def _sample_args(run: Run, i: int) -> dict:
    """What a request carries to the workers: its row, and its loss mask where the format stores one."""
    mask = run.prompts.loss_mask(i) if run.fmt.uses_loss_mask else None
    return {SAMPLE_KEY: i, **({LOSS_MASK_KEY: mask} if mask is not None else {})}


def _shutdown(llm) -> None:
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def _bytes_per_token(llm, cfg: dict, opts: ExtractOptions, n: int) -> int:
    """What one token's states take: the stored dtype is the store dtype, else the dtype vLLM runs the model in."""
    sizes = dict(_native.dtypes())
    dt = opts.store_dtype
    if dt == "auto":
        dt = str(getattr(getattr(llm.llm_engine, "model_config", None), "dtype", "bfloat16")).removeprefix("torch.")
    return n * model_field(cfg, "hidden_size") * formats.get(opts.format).bytes_per_value(sizes.get(dt, 2))


def quiet_vllm() -> None:
    """Keeps vLLM's INFO chatter out of the terminal unless the user asked for it."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
