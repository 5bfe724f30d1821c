"""GPU benchmark (run on the H200 with vLLM 0.23): plain prefill vs hscapture vs vLLM's own
extract_hidden_states vs a speculators-style Python capture, side by side in one invocation.

    python3 bench/gpu.py --models llama8b,dsv3 --prompts 128 --batch 16 --length 1024 --rounds 2

Each (model, mode) runs in its own process (bench/gpu_run.py); modes alternate per model, and with --repeat K the
whole list runs K times over (a mode whose run-to-run spread is wide, plain eager on the H200, is then compared
pass by pass and by each mode's best run). Prints
tokens/s, each ratio to plain (eager) and to plain_graphs (vLLM's defaults) when they ran, the host time per step
of each hscapture mode, and the ceilings measured in the same invocation (D2H into pinned memory, local-disk write
with fdatasync). Random weights (load_format="dummy"), bf16, `max_tokens=1` unless --decode. Capture files go to
--out (page cache) except `hscapture_durable` (fsync per file).
Modes: plain, hscapture (eager; background assembly, overlapped steps), hscapture_inline (scatter on the worker's
thread), hscapture_serial (each device step collected when the next begins), hscapture_durable, vllm, python;
plain_graphs and hscapture_graphs (vLLM's defaults: torch.compile and CUDA graphs); plain_compiled and
hscapture_compiled (torch.compile without CUDA graphs). Suffixes, with --decode: _prompt (the connector, prompt
rows only), _offline (no connector); any hscapture mode: _w<N> (N writer threads, e.g. hscapture_w2), _nice (the
writer's threads at nice 10 after start-up), _pinned / _apart before _graphs and _w<N> (the engine's main thread on one
CPU; with _apart every other thread of its process on other physical cores: bench/placement.py; e.g. plain_apart,
hscapture_prompt_apart), _early before any other suffix (HSCAPTURE_EARLY_COPY_MIB=4: a large
step's rows copied layer by layer during the forward, e.g. hscapture_early_graphs), _notrim likewise (glibc's malloc never
returns heap memory to the system in that mode's processes, so memory freed and allocated again is never touched for
the first time twice: do the engine thread's page faults cost eager decode? e.g. hscapture_notrim, plain_notrim);
_ab (a connector mode, e.g. hscapture_ab): 2×ROUNDS rounds in one process, capture off (paused, requests without
response rows) and on alternately, each pair's ratio printed: the capture's cost without the drift between processes;
_abc (e.g. hscapture_abc): ROUNDS cycles of four rounds: off, on, paused with the hooks removed, and closed (writer
threads joined, dropped from the worker and freed; the connector stays), the capture built again before each cycle, off and
on swapping places every other cycle, an untimed batch first in each: the capture's presence against the process's own luck.
--decode N: every request also generates N tokens, and the hscapture modes capture prompt and response through the
KV connector (`include_output_tokens`), one `generate` per batch, vLLM's default chunked prefill.
Beside each mode: the worker process's garbage collections and the engine thread's minor faults and CPU time inside
each step's calls (bench/step_watch.py; HSBENCH_WATCH=1: also in hscapture's begin, end and core calls).
HSBENCH_FEED=stream (environment): each round's prompts in one `generate` (vLLM's scheduler fills every step from its
queue, as hscapture's own driver does) instead of one per batch, in every mode.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

SHAPES = {
    # Llama-3-8B shape: hidden 4096, 32 layers
    "llama8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # DeepSeek-V3 shape, 8 layers: hidden 7168, MLA, 64 routed experts + 1 shared, sigmoid noaux_tc routing
    "dsv3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 8,
        "first_k_dense_replace": 1,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 64,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
}
LAYERS = {"llama8b": "2,16,28,30", "dsv3": "1,3,5,6"}  # after-convention ids (vLLM's own path gets id+1)


# glibc reads these at start-up: no heap trimming (the main arena's and the threads' heaps), and every allocation up to
# the largest mmap threshold glibc accepts (32 MiB) from the heap, so that freed memory is reused, not unmapped.
NO_TRIM = {
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TOP_PAD_": str(64 << 20),
}


def d2h_ceiling() -> float:
    import torch

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * n / (time.perf_counter() - t) / 1e9


def disk_ceiling(path: Path, gib: int = 2) -> float:
    f = path / "ddtest.bin"
    block = os.urandom(1 << 24)
    t = time.perf_counter()
    with open(f, "wb") as fh:
        for _ in range(gib * 64):
            fh.write(block)
        fh.flush()
        os.fdatasync(fh.fileno())
    dt = time.perf_counter() - t
    f.unlink()
    return gib * (1 << 30) / dt / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama8b,dsv3")
    ap.add_argument(
        "--modes",
        default="plain,hscapture,vllm,python",
        help="also: hscapture_fp8 (fp8 files, quantized on the GPU), hscapture_fp8_host (quantized in the writer "
        "threads), hscapture_inline, hscapture_serial, hscapture_durable, plain_compiled, "
        "hscapture_compiled (torch.compile without CUDA graphs), plain_graphs (with them)",
    )
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="/tmp/hsbench")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of every run")
    ap.add_argument("--decode", type=int, default=0, help="tokens each request generates (0: prefill only)")
    ap.add_argument("--repeat", type=int, default=1, help="passes over the mode list, one after the other")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"D2H into pinned memory: {d2h_ceiling():.1f} GB/s; disk write with fdatasync: {disk_ceiling(out):.2f} GB/s",
        flush=True,
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    for name in args.models.split(","):
        mdir = out / f"model-{name}"
        mdir.mkdir(exist_ok=True)
        (mdir / "config.json").write_text(json.dumps(SHAPES[name], indent=1))
        passes: list[dict] = []
        for _ in range(max(1, args.repeat)):
            passes.append(run_pass(args, name, mdir, out, env))
        for k, results in enumerate(passes):
            ratios(name if len(passes) == 1 else f"{name} pass {k + 1}", results)
        if len(passes) > 1:
            best = {}
            for results in passes:
                for m, r in results.items():
                    if m not in best or r["tokens"] / r["seconds"] > best[m]["tokens"] / best[m]["seconds"]:
                        best[m] = r
            ratios(f"{name} best of {len(passes)}", best)
            spread(name, passes)


def run_mode(cmd: list[str], env: dict) -> tuple[int | None, str, str]:
    """One mode's run in its own process group: (exit status, or None when it ran past HSBENCH_MODE_LIMIT_S seconds
    and was killed with its engine, its output so far)."""
    limit = float(env.get("HSBENCH_MODE_LIMIT_S", "900"))
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        out, err = p.communicate(timeout=limit)
        return p.returncode, out, err
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # the group ended meanwhile
            os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return None, out or "", err or ""


def run_pass(args: argparse.Namespace, name: str, mdir: Path, out: Path, env: dict) -> dict:
    """Each mode once, in the order given; its results by mode."""
    results = {}
    for mode in args.modes.split(","):
        run_out = out / f"run-{name}-{mode}"
        subprocess.run(["rm", "-rf", str(run_out)])
        cmd = [
            sys.executable,
            str(HERE / "gpu_run.py"),
            mode,
            str(mdir),
            str(run_out),
            str(args.prompts),
            str(args.batch),
            str(args.length),
            LAYERS[name],
            str(args.rounds),
            str(args.tp),
            str(args.decode),
        ]
        t = time.perf_counter()
        rc, stdout, stderr = run_mode(cmd, {**env, **NO_TRIM} if "_notrim" in mode else env)
        line = [ln for ln in stdout.splitlines() if ln.startswith("BENCH_JSON ")]
        if rc != 0 or not line:
            tail = "\n".join((stdout + stderr).splitlines()[-25:])
            why = "its time limit (HSBENCH_MODE_LIMIT_S)" if rc is None else f"exit status {rc}"
            print(f"[{name}/{mode}] FAILED after {time.perf_counter() - t:.0f} s ({why}):\n{tail}", flush=True)
            continue
        res = json.loads(line[-1][len("BENCH_JSON ") :])
        results[mode] = res
        du = subprocess.run(["du", "-sb", str(run_out)], capture_output=True, text=True).stdout.split()
        res["bytes"] = int(du[0]) if du else 0
        tail = ""
        if mode.startswith("hscapture"):
            k = min(range(len(res["drains"])), key=lambda i: res["drains"][i])
            part = (res.get("drain_parts") or [None] * (k + 1))[k] or {}
            split = f" = assemble {part['assemble']:.3f} + write {part['write']:.3f}" if part else ""
            tail = f"; waiting for files after the last step {res['drains'][k]:.3f} s{split}"
        print(
            f"[{name}/{mode}] {res['tokens'] / res['seconds']:,.0f} tok/s (rounds {', '.join(f'{x:.2f}' for x in res['rounds'])} s{tail}; "
            f"{res['bytes'] / 2**30:.2f} GiB on disk ({res['bytes'] / (res['tokens'] * len(res['rounds']) + args.batch * args.length):,.0f} B/token)"
            f"{'; path ' + res['device_path'] if 'device_path' in res else ''}; "
            f"{'feed ' + res['feed'] + '; ' if res.get('feed', 'batches') != 'batches' else ''}"
            f"process {time.perf_counter() - t:.0f} s)",
            flush=True,
        )
        if "ab_off" in res:  # _ab: capture off and on, alternating in one process
            pairs = [a / b for a, b in zip(res["ab_off"], res["rounds"], strict=True)]
            print(
                f"[{name}/{mode}] in one process, capture off and on (_abc: swapping every other cycle): rounds off "
                f"{', '.join(f'{x:.2f}' for x in res['ab_off'])} s, on {', '.join(f'{x:.2f}' for x in res['rounds'])} s; "
                f"on × off per pair {', '.join(f'{x:.3f}' for x in pairs)} (median {statistics.median(pairs):.3f}x; "
                f"best on / best off {min(res['ab_off']) / min(res['rounds']):.3f}x)",
                flush=True,
            )
        for key, what in (
            ("ab_unhooked", "paused with its hooks removed"),
            ("ab_closed", "closed (writer threads joined; its session, buffers and arena freed where `freed`)"),
        ):
            if key not in res:  # _abc: the capture's presence taken away in steps, in the same process
                continue
            xs, proc = res[key], res.get(key.replace("ab_", "") + "_process")
            print(
                f"[{name}/{mode}] then capture {what} ({proc}): rounds {', '.join(f'{x:.2f}' for x in xs)} s; "
                f"time × off's per cycle {', '.join(f'{b / a:.3f}' for a, b in zip(res['ab_off'], xs, strict=False))}; "
                f"best rounds {min(xs) / min(res['ab_off']):.3f}x, mean rounds "
                f"{statistics.mean(xs) / statistics.mean(res['ab_off']):.3f}x",
                flush=True,
            )
        if "round_steps" in res:  # each round: its step calls' median and sum, and the time between them
            print(f"[{name}/{mode}] rounds' steps (median ms of execute_model / sample_tokens; s in them / between):")
            for r in res["round_steps"]:
                ex, sa = r.get("execute_model", [0, 0, 0, 0]), r.get("sample_tokens", [0, 0, 0, 0])
                between = r.get("span_s", 0) - ex[3] - sa[3]
                print(
                    f"    {r['phase']:>8}: {ex[0]} steps, {ex[1]:.2f} / {sa[1]:.2f} ms (p90 {ex[2]:.2f} / {sa[2]:.2f}); "
                    f"{ex[3] + sa[3]:.2f} s in them, {between:.2f} s between",
                    flush=True,
                )
        if "allocator" in res:  # CUDA caching-allocator counts over the timed rounds (each can synchronise)
            print(f"[{name}/{mode}] allocator over the rounds: {res['allocator']}", flush=True)
        if "thread_cpu_s" in res:  # CPU seconds per thread name over the rounds: the capture's threads vs the engine's
            print(f"[{name}/{mode}] worker threads' CPU seconds over the rounds: {res['thread_cpu_s']}", flush=True)
        if "thread_switches" in res:  # [voluntary, involuntary]: waits (GIL, locks, the GPU) vs cores taken away
            print(
                f"[{name}/{mode}] their context switches [voluntary, involuntary]: {res['thread_switches']}", flush=True
            )
        if "thread_minflt" in res:  # first touches of memory (and remaps) per thread
            print(f"[{name}/{mode}] their minor page faults: {res['thread_minflt']}", flush=True)
        if "watch" in res:  # bench/step_watch.py: where the engine thread's faults and collections fall
            print(
                f"[{name}/{mode}] garbage collections [n, ms] and the step's calls [calls, minor faults, CPU ms]: "
                f"{res['watch']}",
                flush=True,
            )
        if "thread_migrations" in res:  # moves between CPUs per thread (each starts it on cold caches)
            print(f"[{name}/{mode}] their migrations between CPUs: {res['thread_migrations']}", flush=True)
        if "interrupts" in res:  # the machine's, over the rounds: TLB shootdowns, function calls, rescheduling, ticks
            print(f"[{name}/{mode}] interrupts over the rounds: {res['interrupts']}", flush=True)
        if "cpu_seconds" in res:  # every CPU's, over the rounds: steal = the host ran something else on them
            print(f"[{name}/{mode}] the machine's CPU seconds over the rounds: {res['cpu_seconds']}", flush=True)
        if "numa" in res:  # where the worker's memory lies, per NUMA node (a process's luck?)
            print(f"[{name}/{mode}] the worker's memory per NUMA node: {res['numa']}", flush=True)
        if "clock" in res:  # the engine thread's CPU clock over the rounds (bench/clock.py): a slower core?
            print(f"[{name}/{mode}] clocks over the rounds: {res['clock']}", flush=True)
        if "host_us_per_step" in res:
            print(f"[{name}/{mode}] host µs per step over {res['steps']} steps: {res['host_us_per_step']}", flush=True)
        if "slow_steps" in res:  # an average that a few long steps make, or every step's cost?
            print(f"[{name}/{mode}] steps in which a part took over 1 ms [steps, ms]: {res['slow_steps']}", flush=True)
        subprocess.run(["rm", "-rf", str(run_out)])
    return results


def phases(results: dict) -> dict:
    """Each mode's timed rounds, with an `_ab`/`_abc` mode's capture-off, unhooked and closed rounds as modes of their
    own (``hscapture_abc:off``, ``hscapture_abc:closed``): each can be set against plain's process."""
    out = {}
    for m, r in results.items():
        out[m] = r["rounds"]
        for key, tag in (("ab_off", "off"), ("ab_unhooked", "unhooked"), ("ab_closed", "closed")):
            if r.get(key):
                out[f"{m}:{tag}"] = r[key]
    return out


def spread(name: str, passes: list[dict]) -> None:
    """Each mode's ratio to plain within each pass (the runs next to each other), as min / median / max over the
    passes: the figure that holds when the machine drifts between passes."""
    if not all("plain" in p for p in passes):
        return
    per_mode: dict[str, list[float]] = {}
    for p in passes:
        base = p["plain"]["tokens"] / p["plain"]["seconds"]
        for m, r in p.items():
            per_mode.setdefault(m, []).append(r["tokens"] / r["seconds"] / base)
    cells = [f"{m} {min(xs):.3f}/{statistics.median(xs):.3f}/{max(xs):.3f}x" for m, xs in per_mode.items()]
    print(f"== {name}, per pass vs plain in the same pass (min/median/max of {len(passes)}): " + ", ".join(cells))
    by_mean: dict[str, list[float]] = {}
    for p in passes:
        ref_mean = statistics.mean(p["plain"]["rounds"])
        for m, xs in phases(p).items():
            by_mean.setdefault(m, []).append(ref_mean / statistics.mean(xs))
    cells = [f"{m} {min(xs):.3f}/{statistics.median(xs):.3f}/{max(xs):.3f}x" for m, xs in by_mean.items()]
    print(f"== {name}, per pass by mean rounds (min/median/max of {len(passes)}): " + ", ".join(cells))


def ratios(label_base: str, results: dict) -> None:
    """Ratios to plain eager, and (compiled modes) to plain compiled without CUDA graphs and to vLLM's defaults, and
    (placed modes) to plain with the same placement."""
    for ref in ("plain", "plain_graphs", "plain_compiled", "plain_pinned", "plain_apart"):
        if ref not in results:
            continue
        label = label_base if ref == "plain" else f"{label_base} vs {ref}"
        base = results[ref]["tokens"] / results[ref]["seconds"]
        print(
            f"== {label}: " + ", ".join(f"{m} {r['tokens'] / r['seconds'] / base:.3f}x" for m, r in results.items()),
            flush=True,
        )
        # By the mean round instead of the best, with the _ab phases: a process's rounds move by 10-30 % on a busy
        # host, and the best of few rounds is its luckiest.
        ref_mean = statistics.mean(results[ref]["rounds"])
        print(
            f"== {label}, mean rounds: "
            + ", ".join(f"{m} {ref_mean / statistics.mean(xs):.3f}x" for m, xs in phases(results).items()),
            flush=True,
        )
        # The same runs up to the last step's end (without the wait for its files): the steady-state cost.
        steps = {
            m: min(a - b for a, b in zip(r["rounds"], r["drains"], strict=True))
            for m, r in results.items()
            if r.get("drains")
        }
        if steps:
            print(
                f"== {label}, up to the last step: "
                + ", ".join(f"{m} {results[m]['tokens'] / s / base:.3f}x" for m, s in steps.items()),
                flush=True,
            )


if __name__ == "__main__":
    main()
