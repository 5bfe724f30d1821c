"""From a vLLM worker to its ``WorkerCapture``: the model's facts, the Rust session and its output, the
rank meetings, the capture path (the CUDA device path or host copies), the pipeline-stage link and the
hooks (eager, or traced into vLLM's torch.compile graph; under CUDA graphs their device launches are recorded into
the graphs). Nothing here runs per step."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from .. import _native, envs
from ..adapters import layer_output, vllm_compat
from ..adapters.parallel import refuse_stages_with_tp
from ..adapters.requested import destination, max_growing_sample_mib, outputs_refused
from ..config import CaptureConfig
from ..errors import ConfigError, HscaptureError
from . import hooks, inproc
from .ranksync import RankSync

log = logging.getLogger("hscapture")


def model_facts(vllm_config: Any) -> tuple[int, int, str, str]:
    """(decoder layers, hidden size, activation dtype, model) as vLLM runs the model."""
    mc = vllm_config.model_config
    text = getattr(mc, "hf_text_config", None) or mc.hf_config
    return int(text.num_hidden_layers), int(mc.get_hidden_size()), str(mc.dtype).removeprefix("torch."), str(mc.model)


def assembly_ring() -> int:
    """Step buffers for background assembly (``HSCAPTURE_ASSEMBLY``, ``HSCAPTURE_HOST_RING``); 0 = inline."""
    mode = envs.get("HSCAPTURE_ASSEMBLY")
    if mode not in ("background", "inline"):
        raise ConfigError(f"HSCAPTURE_ASSEMBLY={mode!r} is not valid: expected `background` or `inline`")
    if mode == "inline":
        return 0
    ring = envs.get("HSCAPTURE_HOST_RING")
    if ring < 2:
        raise ConfigError(
            f"HSCAPTURE_HOST_RING={ring} is not valid: background assembly needs at least 2 step buffers; "
            "set HSCAPTURE_ASSEMBLY=inline to assemble on the worker's thread"
        )
    return ring


def build(cls: type, worker: Any, cfg: CaptureConfig) -> Any:
    vc = worker.vllm_config
    ex = vllm_compat.execution(vc)
    pp_size, pp_rank = vllm_compat.pp_info()
    n_layers, hidden, model_dtype, model = model_facts(vc)
    layer_ids = cfg.resolve(n_layers)
    tp = vllm_compat.TPGroup()
    refuse_stages_with_tp(pp_size, tp.size)  # also checked before the engine starts (early_check)
    vllm_compat.refuse_prompt_embeds(vc.model_config)  # likewise
    writer = tp.rank == 0 and pp_rank == pp_size - 1  # the last stage assembles (pipeline.py)
    out_dtype = model_dtype if cfg.dtype == "auto" else cfg.dtype
    # What each hooked layer's output is, before anything is opened: the capture's identity records it.
    name, layers = hooks.find_decoder_layers(worker.get_model(), n_layers)
    outputs = layer_outputs(layers, _native.capture_points(list(layer_ids), cfg.convention, n_layers), cfg.layer_output)
    dest = destination(cfg)
    store = None
    if dest["kind"] == "store" and not writer:
        dest = {"kind": "memory"}  # only the writing rank opens the store; the others verify
    elif dest["kind"] == "store":
        from ..output.mooncake import Store

        store = dest["client"] = Store(cfg.per_request.store).open()
    output = _native.Output(
        dest,  # opened on the writing rank only (the others verify): the core decides
        writer_threads=cfg.writer_threads,
        writer_queue=cfg.writer_queue,
        model=cfg.model_name or model,
        max_growing_sample_mib=max_growing_sample_mib(),
        layer_output=identity_rule(outputs),
        outputs_refused=outputs_refused(vc),
    )
    staging = dest["kind"] == "staging"
    if staging and (envs.get("HSCAPTURE_TEST_STAGING_DELAY_MS") > 0 or envs.get("HSCAPTURE_TEST_STAGING_HOLD")):
        output = output.on_slow_disk(
            max(0, envs.get("HSCAPTURE_TEST_STAGING_DELAY_MS")), envs.get("HSCAPTURE_TEST_STAGING_HOLD")
        )
    session = _native.CaptureSession(
        layer_ids, cfg.convention, n_layers, hidden, model_dtype, out_dtype, assemble=writer, output=output
    )
    warn_if_nothing_is_written(writer, cfg, store)
    session.set_skip_nonfinite(cfg.on_nonfinite == "skip")
    ring = assembly_ring()
    if writer and ring:
        session.set_background(ring)
    sync = RankSync(tp, int(getattr(worker, "rank", 0)), cfg.out)
    points = cls.points_of(session)  # the same points, unless a subclass moves them (the fault tests do)
    link = None
    if pp_size > 1:
        from .pipeline import StageLink

        local = [slot for slot, (_kind, k) in enumerate(points) if not hooks.is_missing(layers[k])]
        link = StageLink(session, pp_size, pp_rank, tp.rank, local, len(points))
    failure: HscaptureError | None = None
    try:
        path = (
            DevicePath("host") if pp_size > 1 and torch.cuda.is_available() else enable_device(session, cfg, writer, vc)
        )
    except HscaptureError as e:  # reported after the ranks compared paths, so that none waits for this one
        path, failure = DevicePath("failed"), e
    sync.agree_on_path(path.kind, path.overlap, failure)
    codes = None
    try:
        order = vllm_compat.RunnerOrder(worker.model_runner)
        if ex.graphs:
            check_graphs(ex, path, pp_size, tp.size, order, vc)
        if ex.compiled:
            codes = trace_codes(vc, session)
            if isinstance(getattr(vc, "additional_config", None), dict):  # what the taps are given: in the cache key
                vc.additional_config["hscapture_layer_output"] = outputs
    except BaseException:
        session.finish()  # nothing stays active (as install_hooks leaves it on failure)
        raise
    cap = cls(
        cfg,
        session,
        sync,
        order,
        writer=writer,
        link=link,
        model_dtype=model_dtype,
        path=path,
        # A device step is collected when a later step runs; the step that reports a server's finished requests
        # always comes, but an engine in the caller's process steps only inside `generate`: its last files would
        # wait for the next call while their clients wait for them.
        settle_each_step=staging and path.kind == "device" and vllm_compat.engine_in_caller(),
        traced_points=codes,
    )
    order.before_forward = cap.before_forward
    install_hooks(cap, layers, points)
    if vllm_compat.engine_in_caller() and tp.size == 1 and link is None:  # the connector may finish requests at once
        inproc.register(vc, cap)
    log.info(
        "hscapture: capturing %s ids %s at %s (%d hooks; %s; %s%s), tp rank %d/%d, pp rank %d/%d, writer=%s",
        cfg.convention,
        cap.layer_ids,
        name,
        len(cap.handles),
        "; ".join(
            f"{layer_cls}: {'hidden_states + residual' if rule == 'sum' else 'hidden_states'}"
            f" ({'set' if cfg.layer_output != 'auto' else 'read from its forward'})"
            for layer_cls, rule in outputs.items()
        )
        or "no layer output hooked here",
        ex.describe(),
        ": traced into torch.compile's graph" if ex.compiled else "",
        tp.rank,
        tp.size,
        pp_rank,
        pp_size,
        writer,
    )
    return cap


@dataclass(frozen=True)
class DevicePath:
    """How rows leave the GPU: ``device`` (kernel + arena + async copies; ``overlap``: steps kept in flight, collected while the
    next runs; ``fp8``: quantized there), ``host`` (copies in the hook; slow, correct), ``none`` (the model is not
    on CUDA) or ``failed`` (the device path was required and could not be set up)."""

    kind: str = "none"
    overlap: int = 0
    fp8: bool = False


def early_copy_bytes() -> int | None:
    """`HSCAPTURE_EARLY_COPY_MIB` as the device's threshold in bytes of rows per layer (None: never; 0 MiB: every
    step, 1 byte)."""
    mib = int(envs.get("HSCAPTURE_EARLY_COPY_MIB"))
    return None if mib < 0 else max(min(mib << 20, 2**60), 1)


def enable_device(session: Any, cfg: CaptureConfig, writer: bool, vc: Any) -> DevicePath:
    """The capture path for CUDA tensors: the device path where it can be set up, else host copies."""
    if not torch.cuda.is_available() or getattr(vc.device_config, "device_type", "cuda") != "cuda":
        return DevicePath("none")
    mode = envs.get("HSCAPTURE_DEVICE_PATH")
    if mode == "off":
        return DevicePath("host")
    from .cuda_libs import preload_nvrtc

    preload_nvrtc()
    rows = int(vc.scheduler_config.max_num_batched_tokens)
    overlap = int(envs.get("HSCAPTURE_DEVICE_OVERLAP"))
    if overlap not in (0, 1, 2):
        raise ConfigError(
            f"HSCAPTURE_DEVICE_OVERLAP={overlap} is not valid: expected 0, 1 or 2 device steps kept in flight"
        )
    early = early_copy_bytes()  # a bad value is the user's error, not a reason to fall back to host copies
    try:
        # The assembler's ring (ranks that only verify need one buffer), plus the steps in flight (with overlap the
        # device arena has two halves: one step's kernels write one while the step before is copied from the other).
        ring = ((assembly_ring() if session.background else 0) or 1) + overlap
        # fp8 files from the device path: quantized on the GPU after each step's last layer (codes and scales cross
        # PCIe), on the rank that writes them.
        fp8 = bool(writer and cfg.format == "fp8" and cfg.out and envs.get("HSCAPTURE_FP8_ON_DEVICE"))
        small = decode_rows(vc)
        arch = session.enable_device(torch.cuda.current_device(), rows, ring, overlap, fp8, small, early)
    except HscaptureError as e:
        if mode == "required":
            raise
        log.warning("hscapture: the CUDA capture path is unavailable (%s); copying to the host in the hook", e)
        return DevicePath("host")
    log.info(
        "hscapture: CUDA capture kernel built for %s; device arena %.1f MiB for %d rows%s; %d pinned host "
        "buffer(s)%s, assembly %s, steps %s%s",
        arch,
        session.device_bytes / 2**20,
        rows,
        " in two halves" if overlap else "",
        ring,
        f" and {ring} of {small} rows for decode steps" if 0 < small < rows else "",
        "on the assembler thread" if session.background else "inline",
        f"{overlap} in flight" if overlap else "collected when the next begins",
        ", fp8 quantized on the device" if fp8 else "",
    )
    return DevicePath("device", overlap, fp8)


def decode_rows(vc: Any) -> int:
    """Rows per layer of the largest decode step: each running request's next token and its speculative ones
    (``max_num_seqs`` × (1 + ``num_speculative_tokens``)). The device path keeps pinned buffers of that size besides
    the full ones (``max_num_batched_tokens`` rows), so that a decode step never waits for a full one the assembler
    still reads after a prompt step. 0 (none) where vLLM's config does not say."""
    seqs = int(getattr(vc.scheduler_config, "max_num_seqs", 0) or 0)
    spec = getattr(vc, "speculative_config", None)
    k = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
    return seqs * (1 + k)


def warn_if_nothing_is_written(writer: bool, cfg: CaptureConfig, store: Any) -> None:
    """The writing rank with neither an output directory nor a store keeps its samples in memory for the RPC surface:
    said once at start-up, since a user who forgot `out` would otherwise find nothing on disk."""
    if writer and cfg.out is None and store is None:
        log.warning(
            "hscapture: no output directory (`out`) is set: captured samples are kept in memory for the RPC "
            "surface (`_get_captured_states`) and nothing is written to disk"
        )


def check_graphs(ex: Any, path: DevicePath, pp_size: int, tp_size: int, order: Any, vc: Any) -> None:
    """Under CUDA graphs the capture lives in the graph: vLLM records the hooks' device launches when it captures its
    graphs, and every replay stores the step armed before it (``cuda/mod.rs``). Refused, naming what to set instead,
    where that cannot work."""
    from ..errors import CompatibilityError

    eager = "start vLLM with --enforce-eager (or compilation_config cudagraph_mode NONE)"
    if pp_size > 1:
        raise CompatibilityError(
            f"CUDA graphs ({ex.describe()}) with pipeline parallelism ({pp_size} stages): the stages exchange each "
            f"step's rows from host memory, which a replayed graph never fills; expected one stage under CUDA graphs. "
            f"With pipeline stages, {eager}"
        )
    if path.kind != "device":
        why = {
            "host": "host copies in the hooks (HSCAPTURE_DEVICE_PATH=off, or the CUDA capture kernel could not be built: "
            "the worker's log says why)",
            "none": "no CUDA device",
        }.get(path.kind, path.kind)
        raise CompatibilityError(
            f"CUDA graphs ({ex.describe()}) replay the forward without Python, so hscapture captures inside them only "
            f"through its device path; expected it, found {why}. Set HSCAPTURE_DEVICE_PATH=auto (or required), or "
            f"{eager}"
        )
    if not order.pre_forward:
        raise CompatibilityError(
            f"CUDA graphs ({ex.describe()}): the model runner {type(order.runner).__name__} has no step preparation "
            f"hscapture can follow (`prepare_inputs` or `_prepare_inputs`), and a replayed graph calls no hook, so no "
            f"step could be armed before its forward; {eager}, and please report this vLLM version"
        )
    if tp_size > 1 and vllm_compat.sequence_parallel_moe(vc):
        raise CompatibilityError(
            f"CUDA graphs ({ex.describe()}) with sequence-parallel MoE (expert and data parallelism): the residual "
            f"stream is sharded across the {tp_size} TP ranks inside the graph, where hscapture cannot gather it; "
            f"{eager}"
        )


def trace_codes(vc: Any, session: Any) -> tuple[int, ...]:
    """Under torch.compile, each slot's capture point as its tap carries it (traced.py); also put in the config
    vLLM hashes for its compile cache, since settings given by environment variables alone would not be in it."""
    from . import traced

    traced.ensure_ops()
    codes = tuple(int(c) for c in session.point_codes())
    if isinstance(getattr(vc, "additional_config", None), dict):
        vc.additional_config["hscapture_traced_points"] = list(codes)
    return codes


def layer_outputs(layers: Any, points: list, setting: str) -> dict[str, str]:
    """Per class of the decoder layers whose output is hooked here, ``sum`` or ``hidden`` (``layer_output.rule_for``:
    refused at start-up when it cannot be told)."""
    return {
        type(layers[k]).__name__: layer_output.rule_for(layers[k], setting)
        for kind, k in points
        if kind == "layer_output" and not hooks.is_missing(layers[k])
    }


def identity_rule(outputs: dict[str, str]) -> str:
    """The rules of this stage's hooked layers as the capture's identity records them: `sum`, `hidden`, or
    `hidden+sum` (a hybrid model hooked on layers of both kinds); `sum` where none is hooked (what every capture
    stored before the rule was recorded)."""
    return "+".join(sorted(set(outputs.values()))) or "sum"


def install_hooks(cap: Any, layers: Any, points: list) -> None:
    """Eager: the hooks call the capture. Compiled: they call hscapture's ops (traced.py), each tap carrying
    its slot's capture point so that a graph built for other points (vLLM's compile cache) is refused
    instead of filing one layer's states under another's id. On failure nothing stays installed or active."""
    try:
        on_capture, on_positions = cap.on_capture, cap.on_positions
        compiled = cap.traced_points is not None
        if compiled:
            from . import traced

            codes = cap.traced_points
            on_capture = lambda slot, h, r, codes=codes: traced.tap(h, r, slot, codes[slot])  # noqa: E731
            on_positions = traced.positions
        cap.handles = hooks.install(layers, points, on_capture, cap.cfg.layer_output)
        if cap.tp.size > 1:  # a sharded residual stream exists only across TP ranks
            cap.handles += hooks.install_positions_probe(layers, on_positions)
        if compiled:
            traced.activate(cap.on_traced, cap.on_positions)
            cap.traced_active = True
    except BaseException:
        for h in cap.handles:
            h.remove()
        cap.handles = []
        cap.session.finish()
        raise
