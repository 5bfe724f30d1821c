"""One benchmark run (a fresh process per run): MODE MODEL_DIR OUT_DIR PROMPTS BATCH LENGTH LAYERS [ROUNDS [TP [DECODE]]]
Prints one JSON line: tokens, seconds (best round), per-round figures, and for hscapture modes the host time each
step spent in the capture (``hscapture_stats``). See bench/gpu.py.

DECODE > 0: each request also generates DECODE tokens (greedy, ``ignore_eos``), and hscapture modes capture prompt
and response in one pass through its KV connector (``include_output_tokens``), files in OUT_DIR; vLLM's default
``max_num_batched_tokens`` (chunked prefill). DECODE = 0: prefill only (``max_tokens=1``), one step per batch."""

import json
import os
import re
import sys
import threading
import time

import step_watch  # bench/: it travels to the worker by reference (the worker's path is this one's)
from capture_control import close_capture, pause_capture, renice_writers, reopen_capture, unhook_capture

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# `memory_stats` below travels to the workers as a function (vLLM sends callables only with this set).
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

ALLOCATOR_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams", "num_ooms")


def memory_stats(worker) -> dict:
    """A worker's CUDA caching-allocator counters: a step that frees and re-allocates device memory, or retries an
    allocation after emptying the cache, synchronises the device (diagnosis of a slower step)."""
    import torch

    st = torch.cuda.memory_stats()
    return {k: st.get(k, 0) for k in ALLOCATOR_COUNTS}


def thread_cpu(worker) -> dict:
    """Per thread of the worker's process: CPU seconds used, and voluntary and involuntary context switches (a thread
    that waits, for the GIL or a lock, switches voluntarily; one that other threads take the core from, involuntarily).
    Python's threads are named by their Python name (the engine's main thread, vLLM's input and output threads all
    carry the process's name in the kernel), the others (the capture's, the allocator's) by the kernel's: whether the
    capture's threads take cores from the engine's, and which of the engine's threads does more work."""
    import os
    import threading

    from placement import migrations

    py_names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{t}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{t}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # a thread that ended meanwhile
            continue
        fields = stat.rpartition(")")[2].split()
        name = py_names.get(int(t), name)
        switches = [
            int(status.get(k, "0").strip() or 0) for k in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")
        ]
        # utime + stime; the switches; minor page faults (memory touched for the first time, or remapped); moves
        # between CPUs (each starts the thread on cold caches)
        out[f"{t}:{name}"] = [(int(fields[11]) + int(fields[12])) / tick, *switches, int(fields[7]), migrations(t) or 0]
    return out


def threads_used(llm, before: dict | None) -> dict | None:
    """Per thread name, [CPU seconds, voluntary, involuntary context switches, minor faults, migrations] since
    ``before`` (a ``thread_cpu`` reading), most CPU first; None on failure."""
    try:
        now = llm.collective_rpc(thread_cpu)[0]
    except Exception as e:  # noqa: BLE001 - a diagnosis only
        print(f"thread CPU times unavailable: {type(e).__name__}: {e}", flush=True)
        return None
    if before is None:
        return now
    used: dict[str, list] = {}
    for k, v in now.items():
        name, was = k.partition(":")[2], before.get(k, [0.0, 0, 0, 0, 0])
        acc = used.setdefault(name, [0.0, 0, 0, 0, 0])
        for i in range(5):
            acc[i] += v[i] - was[i]
    rows = ((k, [round(v[0], 2), *v[1:]]) for k, v in used.items() if v[0] >= 0.01)
    return dict(sorted(rows, key=lambda kv: -kv[1][0]))


def rpc_or_none(llm, fn):
    """``fn`` run in the worker's process (TP=1: one), or None where it failed (a diagnosis only)."""
    try:
        return llm.collective_rpc(fn)[0]
    except Exception as e:  # noqa: BLE001 - a diagnosis only
        print(f"{fn.__name__} in the worker unavailable: {type(e).__name__}: {e}", flush=True)
        return None


IRQ_KINDS = ("TLB", "CAL", "RES", "LOC")


def interrupts() -> dict | None:
    """This machine's interrupts so far, summed over CPUs, of the kinds that take a core from a thread without its
    asking: TLB shootdowns (another thread of a process unmapped memory), function calls, rescheduling, timer ticks.
    Many TLB shootdowns while the writer threads free large buffers would slow the engine's thread everywhere. DEV:
    every device's interrupts together (the disk's among them), whose handlers take cycles from whatever thread runs."""
    try:
        with open("/proc/interrupts") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    n_cpus, out = len(lines[0].split()), {"DEV": 0}
    for line in lines[1:]:
        kind, _, rest = line.partition(":")
        n = sum(int(x) for x in rest.split()[:n_cpus] if x.isdigit())
        if kind.strip() in IRQ_KINDS:
            out[kind.strip()] = n
        elif kind.strip().isdigit():  # a device's (the disk's queues, the NIC's): their handlers run on any core
            out["DEV"] += n
    return out


def cpu_times() -> dict | None:
    """The machine's CPU time so far, summed over CPUs, in seconds (/proc/stat): `steal` is time this virtual
    machine's CPUs were ready but the host ran something else, which slows every thread of the guest alike (and, where
    the guest does not account for it, shows as their CPU time)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    return {k: int(v) / hz for k, v in zip(names, fields[1:], strict=False)}


_MEASURED = threading.Event()  # set once the run's result is printed: the engine's shutdown after it is no death


def exit_if_engine_dies(every_s: float = 2.0) -> None:
    """A watchdog thread: once a child process of this run (vLLM's engine core) ends with an error or a signal, this
    run prints why and exits. vLLM's LLM.generate does not return when its engine core dies (shown on vLLM 0.16 for
    CPU with a worker that aborts in execute_model, hscapture or not: "Engine core proc ... died unexpectedly", then
    generate waits for ever), so without this a crashed engine costs the whole device call."""
    import multiprocessing

    def watch() -> None:
        seen = {}
        while True:
            for p in multiprocessing.active_children():
                seen[p.pid] = p
            for pid, p in list(seen.items()):
                if p.exitcode is not None:
                    del seen[pid]
                    if p.exitcode != 0 and not _MEASURED.is_set():
                        why = f"signal {-p.exitcode}" if p.exitcode < 0 else f"exit status {p.exitcode}"
                        print(f"BENCH_ENGINE_DIED {p.name} (pid {pid}) ended with {why}", flush=True)
                        os._exit(3)
            time.sleep(every_s)

    threading.Thread(target=watch, name="bench-engine-watch", daemon=True).start()


def numa_pages(worker) -> dict:
    """MiB of the worker's process resident on each NUMA node (``/proc/self/numa_maps``), and the nodes the machine
    has: eager plain moves ±25 % from one process to the next; a process whose memory lies on the other node from its
    CPUs (pinned with HSBENCH_CPUS, its memory not) would show it here. Empty where the kernel exposes no NUMA."""
    import re

    nodes: dict[str, float] = {}
    try:
        with open("/proc/self/numa_maps") as f:
            for line in f:
                size = re.search(r"kernelpagesize_kB=(\d+)", line)
                kib = int(size.group(1)) if size else 4
                for node, pages in re.findall(r"\bN(\d+)=(\d+)", line):
                    nodes[node] = nodes.get(node, 0.0) + int(pages) * kib / 1024
        with open("/sys/devices/system/node/online") as f:
            online = f.read().strip()
    except OSError:
        return {}
    return {"online": online, "mib": {f"N{k}": round(v) for k, v in sorted(nodes.items())}}


def engine_thread(worker) -> tuple[int, int]:
    """The worker's process and the thread this call runs on: the engine's (at TP 1 the engine core's busy loop
    runs the worker and its calls)."""
    import os
    import threading

    return os.getpid(), threading.get_native_id()


def clock_sampler(llm):
    """A started ``bench/clock.py`` sampler of the engine thread's CPU clock; None on failure."""
    try:
        from clock import ClockSampler

        return ClockSampler(*llm.collective_rpc(engine_thread)[0]).start()
    except Exception as e:  # noqa: BLE001 - a diagnosis only
        print(f"clock sampling unavailable: {type(e).__name__}: {e}", flush=True)
        return None


def captured_steps(llm) -> int:
    """The steps the worker's capture has bracketed so far (the `_ab` modes check that a paused round added none)."""
    return [r for r in llm.collective_rpc("hscapture_stats") if r][0].get("host_ns_steps", 0)


def allocator_counts(llm) -> dict | None:
    try:
        return llm.collective_rpc(memory_stats)[0]
    except Exception as e:  # noqa: BLE001 - a diagnosis only; the benchmark's figures stand without it
        print(f"allocator counters unavailable: {type(e).__name__}: {e}", flush=True)
        return None


if __name__ == "__main__":
    mode, model, out, n_prompts, batch, length, layers = sys.argv[1:8]
    rounds = int(sys.argv[8]) if len(sys.argv) > 8 else 2
    tp = int(sys.argv[9]) if len(sys.argv) > 9 else 1
    decode = int(sys.argv[10]) if len(sys.argv) > 10 else 0
    n_prompts, batch, length = int(n_prompts), int(batch), int(length)
    if os.environ.get("HSBENCH_CPUS"):  # e.g. "0-7": every mode's process (and the engine's) on the same cores
        cpus = set()
        for part in os.environ["HSBENCH_CPUS"].split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        os.sched_setaffinity(0, cpus)  # inherited by the engine process vLLM spawns
    ids = [int(x) for x in layers.split(",")]
    import random

    from vllm import LLM, SamplingParams

    kw = dict(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=length + decode + 16,
        max_num_seqs=batch,
        **({} if decode else {"max_num_batched_tokens": batch * length}),
        gpu_memory_utilization=0.85,
        enable_prefix_caching=False,
        seed=0,
        tensor_parallel_size=tp,
    )
    if os.environ.get("HSBENCH_ASYNC") in ("0", "1"):  # vLLM's asynchronous scheduling forced off/on (every mode)
        kw["async_scheduling"] = os.environ["HSBENCH_ASYNC"] == "1"
    if mode.endswith("_compiled"):  # vLLM's torch.compile (Inductor) without CUDA graphs
        kw["enforce_eager"] = False
        kw["compilation_config"] = {"cudagraph_mode": "NONE"}
    if mode.endswith("_graphs"):  # vLLM's defaults: torch.compile and CUDA graphs (FULL_AND_PIECEWISE)
        kw["enforce_eager"] = False
    if mode == "hscapture_inline":  # the scatter on the worker's thread, as before the assembler thread
        os.environ["HSCAPTURE_ASSEMBLY"] = "inline"
    if mode == "hscapture_serial":  # each device step collected when the next begins, as before the overlap
        os.environ["HSCAPTURE_DEVICE_OVERLAP"] = "0"
    if "_early" in mode:  # a large step's rows copied layer by layer during the forward (early copies)
        os.environ["HSCAPTURE_EARLY_COPY_MIB"] = "4"
    if mode == "hscapture_fp8_host":  # fp8 files quantized in the writer threads instead of on the GPU
        os.environ["HSCAPTURE_FP8_ON_DEVICE"] = "0"
    # With DECODE, bisecting modes: *_prompt* keeps the connector but asks for the prompt only (no
    # include_output_tokens); *_offline* has no connector (the offline writer, prompt rows only).
    connector = mode.startswith("hscapture") and decode and "_offline" not in mode
    if "_noopconn" in mode and connector:
        sys.exit(
            f"{mode}: a no-op connector beside hscapture's own is not a mode (use plain_noopconn or *_offline_noopconn)"
        )
    outputs = connector and "_prompt" not in mode
    # A mode ending in _w<N> (hscapture_w2) runs N writer threads, beside the others in the same invocation.
    writers = re.search(r"_w([0-9]+)$", mode)
    writers = writers.group(1) if writers else os.environ.get("HSBENCH_WRITERS")
    if os.environ.get("HSBENCH_TORCH_PROFILE"):  # vLLM's torch profiler over one extra batch after the timed rounds
        kw["profiler_config"] = {
            "profiler": "torch",
            "torch_profiler_dir": os.path.join(os.environ["HSBENCH_TORCH_PROFILE"], mode),
            "torch_profiler_with_stack": False,
        }
    if connector:  # prompt and response through the KV connector, as a server does
        from vllm.config import KVTransferConfig

        kw["worker_cls"] = "hscapture.worker.CaptureWorker"
        kw["additional_config"] = {"hscapture": {"layers": ids, "convention": "after"}}
        if writers:  # do the writer's threads cost the engine thread its cores?
            kw["additional_config"]["hscapture"]["writer_threads"] = int(writers)
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="HscaptureConnector",
            kv_connector_module_path="hscapture.connector",
            kv_role="kv_producer",
            kv_connector_extra_config={"shared_storage_path": out, "format": "file"},
        )
        os.makedirs(out, exist_ok=True)
    elif mode.startswith("hscapture"):
        kw["worker_cls"] = "hscapture.worker.CaptureWorker"
        kw["additional_config"] = {
            "hscapture": {
                "layers": ids,
                "convention": "after",
                "out": out,
                "durable": mode == "hscapture_durable",
                "writer_queue": 64,
                **({"format": "fp8"} if mode.startswith("hscapture_fp8") else {}),
            }
        }
        if writers:  # default: hscapture's own (one thread per core, 4 to 16)
            kw["additional_config"]["hscapture"]["writer_threads"] = int(writers)
    elif mode == "python":
        os.environ["HSBENCH_LAYERS"], os.environ["HSBENCH_OUT"] = layers, out
        kw["worker_cls"] = "py_capture_worker.PyCaptureWorker"
    elif mode == "vllm":
        kw["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in ids]}},
        }
        kw["kv_transfer_config"] = {
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": out},
        }
        kw["enable_chunked_prefill"] = False
    if "_noopconn" in mode:  # vLLM's connector plumbing alone, with a connector that moves nothing
        from vllm.config import KVTransferConfig

        # This script's folder is already on its own path; the engine's processes find the connector through this.
        here = os.path.dirname(os.path.abspath(__file__))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        # kv_producer, as hscapture's connector: kv_both would add vLLM's deferred block frees under asynchronous
        # scheduling (scheduler.py's defer_block_free), which hscapture's path does not pay.
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NoopConnector", kv_connector_module_path="noop_connector", kv_role="kv_producer"
        )
    prof = os.environ.get("HSBENCH_PROFILE")
    if prof:  # each mode's processes write their stack samples under their own folder
        os.environ["HSBENCH_PROFILE"] = os.path.join(prof, mode)
        os.makedirs(os.environ["HSBENCH_PROFILE"], exist_ok=True)
        for d in (prof, os.environ["HSBENCH_PROFILE"]):
            if os.path.exists(os.path.join(d, "start")):
                os.unlink(os.path.join(d, "start"))
    llm = LLM(**kw)
    exit_if_engine_dies()
    cfg = json.load(open(os.path.join(model, "config.json")))
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(10, cfg["vocab_size"]) for _ in range(length)]} for _ in range(n_prompts)
    ]
    capture = mode.startswith("hscapture")
    extra = {"kv_transfer_params": {"include_output_tokens": True}} if outputs else None
    sp = SamplingParams(max_tokens=max(decode, 1), detokenize=False, ignore_eos=True, temperature=0.0, extra_args=extra)
    # _ab (an hscapture connector mode): rounds alternate, capture off then on, in this one process (the same CPUs,
    # the same neighbours): off, the workers' capture is paused and the requests ask for no response rows, so only
    # vLLM's connector plumbing and the hooks' disarmed launches remain. Each pair's ratio is the capture's cost with
    # the machine's drift between processes taken out. An on round's last batch is written after it (use several
    # batches a round: the earlier ones' files are written while the later ones decode, as a server's are).
    ab = "_ab" in mode
    # _abc: cycles of four rounds instead of pairs: off, on, paused with the layer hooks removed (unhook_capture),
    # and with the capture closed and dropped (close_capture), built again (reopen_capture) before the next cycle:
    # the same process without hscapture's hooks, then without its threads and memory too (close_capture says
    # whether the closed capture was freed), alternating; off and on swap places every other cycle, and an untimed
    # batch (`settle`) opens each cycle. Those against off: what the capture's presence costs; closed against a
    # plain_noopconn process: the process's luck.
    abc = "_abc" in mode
    cycle = 4 if abc else 2 if ab else 1
    if ab and not connector:
        raise SystemExit(f"{mode}: _ab alternates hscapture's connector capture off and on (needs --decode)")
    sp_off = SamplingParams(max_tokens=max(decode, 1), detokenize=False, ignore_eos=True, temperature=0.0)
    sp_flush = SamplingParams(max_tokens=1, detokenize=False, ignore_eos=True, temperature=0.0)

    # HSBENCH_FEED=stream: every prompt in one generate, vLLM's scheduler filling each step from its queue (as
    # hscapture's own driver feeds it: no step without prompt rows between batches); by default one generate per
    # batch, as a client sends them.
    feed = os.environ.get("HSBENCH_FEED", "batches")
    if feed not in ("batches", "stream"):
        raise SystemExit(f"HSBENCH_FEED={feed!r}: expected 'batches' or 'stream'")

    def run_round(params=sp):
        if feed == "stream":
            llm.generate(prompts, params, use_tqdm=False)
            return
        for b in range(0, len(prompts), batch):
            llm.generate(prompts[b : b + batch], params, use_tqdm=False)

    def clear():  # the connector's files: read by nobody here; removed so that disk space stays flat
        if connector:
            for f in os.listdir(out):
                # Not a file being written (hidden until renamed into place): the last requests' samples complete
                # with the next step, after this clear (a partial removed under the writer failed the capture).
                if f.startswith("."):
                    continue
                try:
                    os.unlink(os.path.join(out, f))
                except FileNotFoundError:  # the last request's file, renamed into place meanwhile: next clear()
                    pass

    # _pinned / _apart (before _graphs, _compiled and _w<N>): the engine's main thread on one CPU, and with _apart
    # every other thread of the worker's process on other physical cores (bench/placement.py), again before each
    # round (threads started since inherit the main thread's CPU).
    how = "apart" if "_apart" in mode else "pinned" if "_pinned" in mode else None

    def place():
        if how is None:
            return None
        from placement import place as place_threads

        return llm.collective_rpc(place_threads, args=(how,))

    llm.generate(prompts[:batch], sp, use_tqdm=False)  # warm-up
    if how is not None:
        print(f"threads placed: {place()}", flush=True)
    if "_nice" in mode:  # the writer's threads at nice 10 (they exist once the capture started)
        print(f"writer threads reniced: {llm.collective_rpc(renice_writers)}", flush=True)
    if prof:  # the stack samplers (bench/profile) start now, after start-up and warm-up
        for d in (prof, os.environ["HSBENCH_PROFILE"]):
            open(os.path.join(d, "start"), "w").close()
    if capture:
        llm.collective_rpc("hscapture_drain")
        clear()
        base_stats = [r for r in llm.collective_rpc("hscapture_stats") if r][0]
    watch = rpc_or_none(llm, step_watch.start)  # collections, and faults in the step's calls, from here on
    mem0 = allocator_counts(llm)
    cpu0 = threads_used(llm, None)
    irq0, times0 = interrupts(), cpu_times()
    clock = clock_sampler(llm)
    per, drains, parts, off = [], [], [], []
    round_steps: list[dict] = []  # each timed round's step calls (bench/step_watch.py: medians, sums, span), in order

    def take_steps(phase: str | None = None) -> None:
        """The step calls' wall times since the last take, kept as round ``phase``'s (None: dropped)."""
        if watch is None:
            return
        took = rpc_or_none(llm, step_watch.take_round)
        if phase is not None and took:
            round_steps.append({"phase": phase, **took})

    absent: dict[str, list] = {"ab_unhooked": [], "ab_closed": [], "unhooked_process": [], "closed_process": []}

    def settle() -> None:
        """_abc: an untimed batch at each cycle's start, the capture paused. Whatever a cycle's first round measured, it
        ran slower (vLLM for CPU, tiny Llama: the first round 0.1-0.4 ms a step slower than the third with both
        paused and hooked), so no measured round comes first after the capture was built."""
        llm.collective_rpc(pause_capture, args=(True,))
        llm.generate(prompts[:batch], sp_off, use_tqdm=False)
        llm.collective_rpc(pause_capture, args=(False,))
        take_steps()

    for r in range(cycle * rounds):
        place()
        n_cycle, at = divmod(r, cycle)
        # _abc: off and on swap places every other cycle (unhooked and closed can only follow them)
        phase = (1, 0, 2, 3)[at] if abc and n_cycle % 2 else at
        if abc and at == 0:
            if r > 0:
                llm.collective_rpc(reopen_capture)
            settle()
        if ab and phase != 1:  # capture off (0), unhooked (2) or closed (3): no step of it may be captured
            # The last batch's samples complete with the next step the capture sees (the connector's metadata carries
            # their tokens): one short prompt-only request first, then their files, outside the timed rounds.
            if phase < 3:
                llm.generate(prompts[:1], sp_flush, use_tqdm=False)
                llm.collective_rpc("hscapture_drain")
                clear()
            how_to, key = {0: (pause_capture, None), 2: (unhook_capture, "unhooked"), 3: (close_capture, "closed")}[
                phase
            ]
            done = llm.collective_rpc(how_to, args=(True,) if phase == 0 else ())[0]
            if key:
                absent[f"{key}_process"].append(done)
            seen = captured_steps(llm)
            take_steps()  # the flush's steps are not the round's
            t0 = time.perf_counter()
            run_round(sp_off)
            (off if phase == 0 else absent[f"ab_{key}"]).append(time.perf_counter() - t0)
            take_steps(key or "off")
            if captured_steps(llm) != seen:  # the figures would be of a capture that was not off
                raise SystemExit(
                    f"{mode}: the capture ran steps in a round without it ({seen} -> {captured_steps(llm)})"
                )
            if phase == 0:
                llm.collective_rpc(pause_capture, args=(False,))
            clear()
            continue
        take_steps()
        t0 = time.perf_counter()
        run_round()
        t1 = time.perf_counter()
        take_steps("on" if ab else "round")
        if capture:
            res = [r for r in llm.collective_rpc("hscapture_drain") if r and r.get("writer")]
            path = res[0]["device_path"] if res else "?"
            parts.append(res[0].get("seconds") if res else None)
        per.append(time.perf_counter() - t0)
        drains.append(time.perf_counter() - t1)  # the run's tail: the last step's copy, assembly and writes
        clear()
    if abc:  # the last cycle closed it: built again, so that the worker ends as it began
        llm.collective_rpc(reopen_capture)
    mem1 = allocator_counts(llm)
    cpu1 = threads_used(llm, cpu0) if cpu0 is not None else None
    watched = rpc_or_none(llm, step_watch.read) if watch is not None else None
    irq1, times1 = interrupts(), cpu_times()
    if clock is not None:
        clock.stop()
    if os.environ.get("HSBENCH_TORCH_PROFILE"):  # after the timed rounds: its overhead changes no figure above
        llm.start_profile()
        llm.generate(prompts[:batch], sp, use_tqdm=False)
        llm.stop_profile()  # the table of CUDA time per kernel: <dir>/<mode>/profiler_out_0.txt
        if capture:
            llm.collective_rpc("hscapture_drain")
        clear()
    info = {
        "mode": mode,
        "feed": feed,
        "tokens": n_prompts * (length + decode),
        "generated": n_prompts * decode,
        "seconds": min(per),
        "rounds": per,
        "drains": drains,
        "drain_parts": parts,
    }
    if ab:  # capture off and on, round by round in this process
        info["ab_off"] = off
    if mem0 is not None and mem1 is not None:  # over the timed rounds
        info["allocator"] = {k: mem1[k] - mem0[k] for k in ALLOCATOR_COUNTS}
    if cpu1:  # the worker process's threads over the timed rounds (TP=1: the engine core's process)
        info["thread_cpu_s"] = {k: v[0] for k, v in list(cpu1.items())[:8]}
        info["thread_switches"] = {k: v[1:3] for k, v in list(cpu1.items())[:4]}
        info["thread_minflt"] = {k: v[3] for k, v in list(cpu1.items())[:4]}
        info["thread_migrations"] = {k: v[4] for k, v in list(cpu1.items())[:4]}
    if watched:  # the worker process's collections, the engine thread's faults and CPU in each step's calls
        info["watch"] = watched
    numa = rpc_or_none(llm, numa_pages)
    if numa:
        info["numa"] = numa
    if round_steps:
        info["round_steps"] = round_steps
    if times0 and times1:  # the whole machine's, over the timed rounds
        info["cpu_seconds"] = {
            k: round(times1[k] - times0[k], 2) for k in ("user", "system", "steal", "irq") if k in times1
        }
    if irq0 and irq1:  # the whole machine's, over the timed rounds
        info["interrupts"] = {k: irq1[k] - irq0.get(k, 0) for k in irq1}
    if clock is not None and clock.summary():
        info["clock"] = clock.summary()
    if capture:
        info["device_path"] = path
    if capture and not abc:  # _abc: each cycle's capture was a new session
        st = [r for r in llm.collective_rpc("hscapture_stats") if r][0]
        steps = max(1, st["host_ns_steps"] - base_stats["host_ns_steps"])
        info["host_us_per_step"] = {
            k: round((v - base_stats.get(k, 0)) / steps / 1e3, 1)
            for k, v in st.items()
            if k.startswith(("host_ns_", "ns_")) and k != "host_ns_steps"
        }
        info["steps"] = steps
        info["slow_steps"] = {  # per part, the steps in which it took over 1 ms: [steps, ms in them]
            k.removeprefix("host_slow_"): [
                v[0] - base_stats.get(k, [0, 0])[0],
                round((v[1] - base_stats.get(k, [0, 0])[1]) / 1e6, 1),
            ]
            for k, v in st.items()
            if k.startswith("host_slow_")
        }
    if abc:
        info.update({k: v for k, v in absent.items() if v})
    _MEASURED.set()
    print("BENCH_JSON " + json.dumps(info), flush=True)
