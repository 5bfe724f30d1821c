"""Adapters to vLLM's objects, by feature detection (never by version string).

Everything the capture reads from vLLM's objects at run time goes through this module: the platform's worker
class, the scheduler output, the order the model runner laid a step out in, the tensor-parallel and pipeline
groups. Beyond it, vLLM is used only through its public API where that API is the point: the KV connector's base
class (``connector.py``), the engine arguments and ``LLM`` the CLI drives (``cli/``, ``adapters/early_check.py``),
and the version-keyed shims (``patches/``), each of which names what it patches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from .. import _native, envs
from ..errors import CompatibilityError, ConfigError

log = logging.getLogger("hscapture")
_warned_single_phase = False

SAMPLE_KEY = "hscapture_sample"
"""Key in ``SamplingParams.extra_args`` holding a request's sample index (``hs_{i}``)."""

_PLATFORM_WORKERS = [
    ("is_cpu", "vllm.v1.worker.cpu_worker.CPUWorker"),
    ("is_cuda_alike", "vllm.v1.worker.gpu_worker.Worker"),
    ("is_xpu", "vllm.v1.worker.xpu_worker.XPUWorker"),
]


def platform_worker_qualname() -> str:
    """The worker class the current platform would have used for ``worker_cls="auto"``."""
    override = envs.get("HSCAPTURE_BASE_WORKER")
    if override:
        return override
    from vllm.platforms import current_platform

    for probe, qualname in _PLATFORM_WORKERS:
        fn = getattr(current_platform, probe, None)
        if callable(fn) and fn():
            return qualname
    raise CompatibilityError(
        f"hscapture does not know the default worker of the {type(current_platform).__name__} platform; set "
        "HSCAPTURE_BASE_WORKER to the qualified name of the worker class to extend"
    )


def resolve_qualname(qualname: str) -> type:
    import importlib

    module, _, name = qualname.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise CompatibilityError(f"cannot load the worker class {qualname}: {e}") from e


def _extra(sampling_params: Any) -> dict:
    extra = getattr(sampling_params, "extra_args", None)
    return extra if isinstance(extra, dict) else {}


def sample_index(sampling_params: Any) -> int | None:
    """The sample index hscapture's driver attached; a value a client sent that is not an index in 0..2^63 is
    ignored with a warning (one request's arguments never stop the capture)."""
    v = _extra(sampling_params).get(SAMPLE_KEY)
    if v is None:
        return None
    if type(v) is int and 0 <= v < 2**63:
        return v
    log.warning("hscapture: ignoring %s=%.80r: expected an integer in 0..2^63", SAMPLE_KEY, v)
    return None


def max_tokens(sampling_params: Any) -> int | None:
    """The most tokens the request may generate (vLLM has filled in its default by the time a worker sees it); what
    bounds a sample that grows with them at admission."""
    v = getattr(sampling_params, "max_tokens", None)
    return v if type(v) is int and v >= 0 else None


def loss_mask(sampling_params: Any) -> list[int] | None:
    """The prompt's training mask the driver attached (0/1 per token); any other value a client sent is ignored
    with a warning."""
    v = _extra(sampling_params).get(LOSS_MASK_KEY)
    if v is None:
        return None
    if isinstance(v, (list, tuple)) and all(type(x) is int and x in (0, 1) for x in v):
        return list(v)
    log.warning("hscapture: ignoring %s=%.80r: expected a list of 0 and 1, one per prompt token", LOSS_MASK_KEY, v)
    return None


def complete_pending_sample(worker: Any) -> bool:
    """A driver written for vLLM <= 0.11 never calls ``sample_tokens`` after an ``execute_model`` that
    returned ``None``, and the V1 model runner then refuses the next ``execute_model``: the pending
    ``sample_tokens`` is completed first (its result discarded: such a driver never reads it). True if one
    was pending."""
    global _warned_single_phase
    runner = getattr(worker, "model_runner", None)
    if getattr(runner, "execute_model_state", None) is None:
        return False
    if not _warned_single_phase:
        log.warning(
            "hscapture: the driver skipped sample_tokens() after execute_model(); completing it "
            "(a single-phase driver written for vLLM <= 0.11)"
        )
        _warned_single_phase = True
    worker.sample_tokens(None)
    return True


LOSS_MASK_KEY = "hscapture_loss_mask"
"""Key in ``SamplingParams.extra_args`` holding a request's training mask (0/1 per prompt token), for
formats that store one (``legacy``)."""


def refuse_prompt_embeds(model_config: Any) -> None:
    """A server that takes prompt embeddings (``--enable-prompt-embeds``) lets any client send a request without
    token ids, which no sample can name: one such request would stop the capture for every client. Refused at
    start-up instead, by name."""
    if getattr(model_config, "enable_prompt_embeds", False) is True:
        raise ConfigError(
            "vLLM is set to take prompt embeddings (--enable-prompt-embeds), but hscapture captures token prompts only: "
            "a request sent as embeddings has no token ids for its sample. Expected it off; start without "
            "--enable-prompt-embeds (enable_prompt_embeds=False)"
        )


def include_output_tokens(params: Any) -> bool:
    """Whether a request's ``kv_transfer_params`` ask for the states of its generated tokens too."""
    return isinstance(params, dict) and params.get("include_output_tokens") is True


def step_of(so: Any) -> _native.Step:
    """A scheduler output as the ``Step`` that ``CaptureSession.begin_step`` takes."""
    new = []
    for r in so.scheduled_new_reqs:
        ids = r.prompt_token_ids
        if ids is None:
            raise CompatibilityError(
                f"request {r.req_id!r} has no prompt token ids (prompt embeddings?); hscapture captures token prompts only"
            )
        sp = r.sampling_params
        new.append(
            _native.NewRequest(
                r.req_id,
                list(ids),
                int(r.num_computed_tokens),
                sample=sample_index(sp),
                loss_mask=loss_mask(sp),
                max_tokens=max_tokens(sp),
            )
        )
    c = so.scheduled_cached_reqs
    resumed = getattr(c, "resumed_req_ids", None)
    if resumed is None:  # older layout: a parallel list of flags
        flags = getattr(c, "resumed_from_preemption", None) or [False] * len(c.req_ids)
        resumed = {rid for rid, f in zip(c.req_ids, flags, strict=True) if f}
    finished = list(so.finished_req_ids or ())
    preempted = list(getattr(so, "preempted_req_ids", None) or ())
    # Under hscapture's KV connector (its metadata rides on every scheduler output): the new requests that capture
    # their generated tokens too, and the token ids of those that finished.
    meta = getattr(so, "kv_connector_metadata", None)
    with_outputs, outputs = [], []
    if getattr(meta, "hscapture", False):
        for r in so.scheduled_new_reqs:
            if include_output_tokens((getattr(r.sampling_params, "extra_args", None) or {}).get("kv_transfer_params")):
                with_outputs.append(r.req_id)
        outputs = [(rid, list(tokens)) for rid, tokens in meta.outputs.items()]
    return _native.Step(
        new_requests=new,
        # vLLM's own columns and dict, as they are: every step, at 64 requests, per-request tuples built here cost more
        # than the rest of the step's begin (the core pairs them, and checks the columns' lengths).
        cached_ids=c.req_ids,
        cached_computed=c.num_computed_tokens,
        resumed=set(resumed),
        scheduled=so.num_scheduled_tokens,
        total_tokens=int(so.total_num_scheduled_tokens),
        finished=finished,
        preempted=preempted,
        with_outputs=with_outputs,
        outputs=outputs,
    )


class RunnerOrder:
    """The order in which the model runner laid out the step being executed, read from the runner itself, and the
    point just before the step's forward, where the step is planned (and armed on the device).

    - Model Runner V2 (no ``input_batch``; it sorts each step itself: decodes, short extends, prefills): the
      ``InputBatch`` its ``prepare_inputs`` returned for this step, kept by wrapping that method on the runner
      instance. Its ``query_start_loc_np`` must show each request's tokens consecutive in ``req_ids`` order, and its
      per-request counts must equal the scheduler's; anything else is refused. The forward follows that call.
    - V1 runner (``GPUModelRunner``, ``CPUModelRunner`` of vLLM ≤ 0.33): ``input_batch.req_ids[:num_reqs]`` is the
      persistent batch the forward reads, each request's tokens consecutive; its ``_prepare_inputs`` runs after the
      batch was reordered for the step and before the forward, and is wrapped the same way where it exists.

    ``before_forward`` (if given) is called right after that method returns, on every step that runs a forward;
    ``pre_forward`` says whether this runner has such a point (CUDA graphs need it: a replayed graph calls no hook).
    """

    def __init__(self, model_runner: Any, before_forward: Any = None) -> None:
        self.runner = model_runner
        self._batch: Any = None
        self.before_forward = before_forward
        if hasattr(model_runner, "input_batch"):
            self.kind, method = "v1", "_prepare_inputs"
        elif callable(getattr(model_runner, "prepare_inputs", None)):
            self.kind, method = "v2", "prepare_inputs"
        else:
            raise CompatibilityError(
                f"the model runner {type(model_runner).__module__}.{type(model_runner).__name__} has neither "
                "`input_batch` (V1 runner) nor `prepare_inputs` (Model Runner V2); hscapture cannot read the token order "
                "it uses and will not guess. Please report this vLLM version"
            )
        inner = getattr(model_runner, method, None)
        self.pre_forward = callable(inner)
        self._method = method
        self._wrapper: Any = None
        self._own = vars(model_runner).get(method)  # an instance attribute already there, put back on close
        if self.pre_forward:

            def prepared(*args: Any, **kwargs: Any) -> Any:
                out = inner(*args, **kwargs)
                if self._wrapper is None:  # closed, but another wrapper outside keeps this one in the chain
                    return out
                if self.kind == "v2":
                    self._batch = out
                if self.before_forward is not None:
                    self.before_forward()
                return out

            self._wrapper = prepared
            setattr(model_runner, method, prepared)  # this instance only

    def close(self) -> None:
        """The capture closed: the wrapper must no longer reach it (the runner outlives it, and would keep a closed
        capture's session, pinned buffers and device arena alive through ``before_forward``). The runner's method is
        put back where the wrapper is still the outermost one (a reload's next capture wraps it afresh, not on top);
        under another wrapper it stays, inert."""
        self.before_forward = None
        self._batch = None
        wrapper, self._wrapper = self._wrapper, None
        runner = self.runner
        if wrapper is None or vars(runner).get(self._method) is not wrapper:
            return
        if self._own is None:
            delattr(runner, self._method)  # the class's own method again
        else:
            setattr(runner, self._method, self._own)

    def reset(self) -> None:
        """At the start of each step: the previous step's batch must never be read for this one."""
        self._batch = None

    def order(self, scheduled: dict[str, int] | None = None) -> list[str]:
        if self.kind == "v1":
            batch = self.runner.input_batch
            return list(batch.req_ids[: batch.num_reqs])
        b = self._batch
        if b is None:
            raise CompatibilityError(
                "Model Runner V2 ran a forward for this step without calling `prepare_inputs` (or hscapture's wrapper "
                "was replaced); the step's token order is unknown and hscapture will not guess. Please report this "
                "vLLM version"
            )
        n = int(b.num_reqs)
        ids = list(b.req_ids[:n])
        counts, starts = _ints(b.num_scheduled_tokens[:n]), _ints(b.query_start_loc_np[: n + 1])
        if starts != list(accumulate(counts, initial=0)):
            raise CompatibilityError(
                f"Model Runner V2 laid out this step's {n} requests non-contiguously (query_start_loc {starts[:9]}, "
                f"counts {counts[:8]}); hscapture reads each request's tokens as one consecutive run and will not guess. "
                "Please report this vLLM version and the settings that produced it"
            )
        if scheduled is not None and dict(zip(ids, counts, strict=True)) != scheduled:
            from ..errors import AttributionError

            raise AttributionError(
                f"Model Runner V2's batch for this step ({dict(list(zip(ids, counts, strict=True))[:6])}) does not hold the tokens the "
                f"scheduler scheduled ({dict(list(scheduled.items())[:6])}); speculative drafts or padding? hscapture "
                "captures only what the scheduler attributes"
            )
        return ids


def _ints(values: Any) -> list[int]:
    """A runner's per-request numbers (numpy arrays, once a step) as Python ints, in one call where they are arrays."""
    return values.tolist() if hasattr(values, "tolist") else [int(x) for x in values]


_VLLM_COMPILE = 3  # vLLM's CompilationMode.VLLM_COMPILE (0.16 to 0.32; the older `level` PIECEWISE was 3 too)


def engine_in_caller() -> bool:
    """Whether vLLM's engine core runs in the caller's process (``LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
    it then steps only while a ``generate`` waits for outputs, so after the last one no step comes (an engine core
    process of its own steps once more to report the finished requests)."""
    try:
        import vllm.envs as venvs

        return not bool(venvs.VLLM_ENABLE_V1_MULTIPROCESSING)
    except (ImportError, AttributeError):
        return False


@dataclass(frozen=True)
class Execution:
    """How vLLM will run the model: ``compiled`` (through torch.compile: the hooks are traced into its graph and call
    hscapture's ops, ``traced.py``) and ``graphs`` (the ``cudagraph_mode`` when CUDA graphs replay the forward, else
    None: the capture then lives in the graph through the device path, ``wiring.py``)."""

    mode: int = 0
    graphs: str | None = None

    @property
    def compiled(self) -> bool:
        return self.mode != 0

    def describe(self) -> str:
        parts = [f"compilation mode {self.mode}" if self.compiled else "eager"]
        if self.graphs:
            parts.append(f"cudagraph_mode {self.graphs}")
        return ", ".join(parts)


def execution(vllm_config: Any) -> Execution:
    """How vLLM will run the model (see ``Execution``). Refuses what cannot be verified: vLLM's sequence-parallelism
    pass (it shards the residual across TP ranks inside the compiled graph, where the taps see only a shard) and
    dual-batch overlap (two micro-batches of one step through the layers, each a part of the step's rows)."""
    cc = getattr(vllm_config, "compilation_config", None)
    mode = getattr(cc, "mode", None)
    if mode is None:
        mode = getattr(cc, "level", 0)
    mode = int(mode or 0)
    graphs = getattr(cc, "cudagraph_mode", None)
    name = None if graphs is None else str(getattr(graphs, "name", graphs))
    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cuda"))
    if name == "NONE" or device == "cpu":
        name = None  # vLLM's CPU platform replays no graphs
    pc = getattr(vllm_config, "parallel_config", None)
    for flag in ("enable_dbo", "use_ubatching"):
        if getattr(pc, flag, None) is True:
            raise CompatibilityError(
                f"vLLM's dual-batch overlap is on (parallel_config.{flag}): each step's tokens go through the layers as "
                "two micro-batches, and hscapture attributes whole steps; expected it off. Start vLLM without "
                "--enable-dbo"
            )
    # vLLM runs its inductor passes in VLLM_COMPILE only; the CPU platform traces once (DYNAMO_TRACE_ONCE).
    passes = getattr(cc, "pass_config", None) if mode == _VLLM_COMPILE else None
    for flag in ("enable_sp", "enable_sequence_parallelism"):  # vLLM's names for the pass, newer and older
        if getattr(passes, flag, None) is True:
            raise CompatibilityError(
                f"vLLM's sequence-parallelism pass is on (compilation_config.pass_config.{flag}=True): it shards "
                "the residual across the TP ranks inside the compiled graph, where hscapture's taps see only a shard; "
                f'turn it off (`--vllm-arg \'compilation_config={{"pass_config": {{"{flag}": false}}}}\'`, '
                "or the same compilation_config in vllm.LLM) or run eager (no --compile / enforce_eager=True)"
            )
    return Execution(mode, name)


def sequence_parallel_moe(vllm_config: Any) -> bool:
    """Whether MoE layers shard the residual stream across the TP ranks (vLLM's sequence-parallel MoE, with expert
    parallelism and data parallelism): the layers' tensors then hold a shard of the step's rows."""
    pc = getattr(vllm_config, "parallel_config", None)
    flag = getattr(pc, "use_sequence_parallel_moe", None)
    return bool(flag() if callable(flag) else flag)


class TPGroup:
    """The tensor-parallel group, as far as hscapture needs it."""

    def __init__(self) -> None:
        from vllm.distributed.parallel_state import get_tp_group

        g = get_tp_group()
        self.size = int(g.world_size)
        self.rank = int(g.rank_in_group)
        self._cpu_group = g.cpu_group

    def gather_rows(self, t: Any) -> Any:
        """The TP ranks' row shards of one tensor, concatenated in rank order (vLLM's all-gather:
        NCCL on GPUs, gloo/shared memory on CPU)."""
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group().all_gather(t.contiguous(), dim=0)

    def start_all_gather_i64s(self, values: list[int]) -> Any:
        """Every rank's list of int64 (all of the same length), in rank order, over the CPU group: started
        without waiting; returns a function that waits and gives the result. Collectives are paired across
        ranks in the order they are issued, started or not."""
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.size)]
        work = dist.all_gather(out, t, group=self._cpu_group, async_op=True)

        def finish() -> list[list[int]]:
            work.wait()
            return [x.tolist() for x in out]

        return finish

    def all_gather_i64s(self, values: list[int]) -> list[list[int]]:
        return self.start_all_gather_i64s(values)()

    def all_gather_i64(self, value: int) -> list[int]:
        if self.size == 1:
            return [value]
        return [r[0] for r in self.all_gather_i64s([value])]


def pp_info() -> tuple[int, int]:
    from vllm.distributed.parallel_state import get_pp_group

    g = get_pp_group()
    return int(g.world_size), int(g.rank_in_group)


def pp_stage_ranks() -> list[int]:
    """The global ranks of this tensor-parallel position, one per pipeline stage, first to last."""
    from vllm.distributed.parallel_state import get_pp_group

    return [int(r) for r in get_pp_group().ranks]
