"""``hscapture extract``: prompts in, one safetensors file per prompt plus a manifest out.

Drives vLLM through its public ``LLM`` API (``max_tokens=1``), with ``CaptureWorker`` doing the
capture in every worker process; the writing rank writes the files, this driver the manifest.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import _native, failures, runtime_env
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

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def lines(self) -> list[str]:
        return [
            f"samples     {self.samples}",
            f"tokens      {self.tokens}",
            f"bytes       {self.bytes} ({self.bytes / 2**20:.1f} MiB)",
            f"throughput  {self.tokens_per_s:,.0f} tokens/s ({self.seconds:.1f} s capture)",
            f"layers      {self.layer_ids} ({self.convention} convention), {self.dtype}",
            f"output      {self.out}/hidden_states/hs_{{i}}.safetensors + manifest.json",
        ]


def prepare_out(out: Path, overwrite: bool) -> None:
    hs = out / "hidden_states"
    existing = (out / "manifest.json").exists() or (hs.is_dir() and any(hs.iterdir()))
    if existing and not overwrite:
        raise OutputError(
            f"{out} already holds captured states; pass --overwrite to replace them, or choose another --out"
        )
    if existing:
        shutil.rmtree(hs, ignore_errors=True)
        (out / "manifest.json").unlink(missing_ok=True)
    try:
        hs.mkdir(parents=True, exist_ok=True)
        probe = hs / ".hscapture-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise OutputError(f"cannot write to {hs}: {e}; choose a directory you can write") from None


def _shutdown(llm) -> None:
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def run_extract(opts: ExtractOptions) -> ExtractReport:
    model_cfg = read_model_config(opts.model)
    n_layers = int(text_config(model_cfg)["num_hidden_layers"])
    layers = opts.layers if opts.layers is not None else _native.default_layers(opts.convention, n_layers)
    ids = _native.validate_layers(list(layers), opts.convention, n_layers)
    check_prompts(opts.prompts, model_cfg)
    out = Path(opts.out).resolve()
    prepare_out(out, opts.overwrite)
    failures.clear(out)
    if opts.tp < 1:
        raise ConfigError(f"--tp must be at least 1, found {opts.tp}")

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
        params = [SamplingParams(max_tokens=1, detokenize=False, extra_args={SAMPLE_KEY: i}) for i in range(len(opts.prompts))]
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in opts.prompts], params, use_tqdm=opts.progress)
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
    w = writers[0]
    records = w["records"]
    got = {r["index"] for r in records}
    missing = sorted(set(range(len(opts.prompts))) - got)
    if missing:
        raise OutputError(
            f"{len(missing)} of {len(opts.prompts)} prompts produced no file (first: {missing[:10]}); aborted requests: "
            f"{w['aborted'][:5]}"
        )
    import vllm

    manifest = {
        "format": "hscapture/1",
        "model": str(opts.model),
        "layer_ids": w["layer_ids"],
        "convention": w["convention"],
        "dtype": w["dtype"],
        "hidden_size": w["hidden_size"],
        "num_hidden_layers": w["num_hidden_layers"],
        "tensor_parallel_size": w["tp_size"],
        "created_by": {"hscapture": _native.__version__, "vllm": getattr(vllm, "__version__", "?")},
        "samples": records,
    }
    _native.write_manifest(str(out / "manifest.json"), json.dumps(manifest))
    return ExtractReport(
        out=str(out),
        samples=len(records),
        tokens=sum(r["length"] for r in records),
        bytes=sum(r["bytes"] for r in records),
        seconds=seconds,
        layer_ids=list(w["layer_ids"]),
        convention=w["convention"],
        dtype=w["dtype"],
        shims=shims,
        device_path=w.get("device_path", "none"),
    )


def quiet_vllm() -> None:
    """Keeps vLLM's INFO chatter out of the terminal unless the user asked for it."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
