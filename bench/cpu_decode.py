"""Decode with prompt + response captured, on vLLM for CPU: the engine's whole step (scheduler, runner, connector,
capture) with and without hscapture, side by side in one invocation, without the H200. A tiny Llama's forward costs
little on the CPU, so the step is host-bound there as an eager GPU decode step is: what hscapture adds to the host's
step shows. (The CPU path copies rows in the hooks, which a GPU does with a launch: `capture` below is CPU-only.)

    python bench/cpu_decode.py [--modes plain,offline,prompt,outputs] [--repeat 2] [--requests 64] [--prompt 64]
                               [--decode 96] [--profile] [--eager] [--place pinned|apart]

Modes: plain (vLLM alone); offline (hscapture's worker, no connector: prompt rows only, decode steps capture
nothing); prompt (its KV connector, prompt only); outputs (the connector with ``include_output_tokens``: every decode
step captures each request's row). Each run is a fresh process with the engine in it
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one warm-up generate, then 3 timed ones; prints ms a step (best), the CPU
seconds of each thread name over the timed runs, the collections and the engine thread's faults in each step's calls
(bench/step_watch.py), and hscapture's host µs a step (``hscapture_stats``).
``--profile``: cProfile of the last timed generate, the functions whose own time grew most against plain."""

from __future__ import annotations

import argparse
import json
import os
import pstats
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ("plain", "offline", "prompt", "outputs")


def thread_cpu() -> dict[str, float]:
    """CPU seconds per (thread id, name) of this process."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for t in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{t}/stat").read_text()
            name = Path(f"/proc/self/task/{t}/comm").read_text().strip()
        except OSError:
            continue
        f = stat.rpartition(")")[2].split()
        out[f"{t}:{name}"] = (int(f[11]) + int(f[12])) / tick
    return out


def run(mode: str, model: str, out: str, a: argparse.Namespace, profile: str | None) -> None:
    """One mode in this process; prints one ``CPU_DECODE`` JSON line."""
    import random
    import threading
    import time

    from vllm import LLM, SamplingParams

    kw: dict = dict(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=a.prompt + a.decode + 16,
        max_num_seqs=a.requests,
        enable_prefix_caching=False,
        seed=0,
        enforce_eager=a.eager,
        # On the CPU backend this is the share of the machine's memory reserved for the KV cache: vLLM 0.32's default
        # (0.92) fails at start-up while the previous mode's process still gives its memory back.
        gpu_memory_utilization=0.5,
    )
    layers = {"layers": [0, 1, 2], "convention": "after"}
    if mode == "offline":
        kw["worker_cls"] = "hscapture.worker.CaptureWorker"
        kw["additional_config"] = {"hscapture": {**layers, "out": out}}
    elif mode in ("prompt", "outputs"):
        from vllm.config import KVTransferConfig

        kw["worker_cls"] = "hscapture.worker.CaptureWorker"
        kw["additional_config"] = {"hscapture": layers}
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="HscaptureConnector",
            kv_connector_module_path="hscapture.connector",
            kv_role="kv_producer",
            kv_connector_extra_config={"shared_storage_path": out, "format": "file"},
        )
    llm = LLM(**kw)
    vocab = json.loads(Path(model, "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(a.prompt)]} for _ in range(a.requests)]
    extra = {"kv_transfer_params": {"include_output_tokens": True}} if mode == "outputs" else None
    sp = SamplingParams(max_tokens=a.decode, detokenize=False, ignore_eos=True, temperature=0.0, extra_args=extra)
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up
    placed = None
    if a.place:  # the engine runs on this process's main thread (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        from placement import place

        placed = place(None, a.place)
    capture = mode != "plain"
    base = [r for r in llm.collective_rpc("hscapture_stats") if r][0] if capture else {}
    import step_watch

    llm.collective_rpc(step_watch.start)  # collections, and the engine thread's faults in each step's calls
    from placement import migrations

    moves0 = migrations(threading.get_native_id())
    cpu0, times = thread_cpu(), []
    prof = None
    for i in range(3):
        if profile and i == 2:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        times.append(time.perf_counter() - t)
    watched = llm.collective_rpc(step_watch.read)[0]
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)
    used: dict[str, float] = {}
    for k, v in thread_cpu().items():
        name = k.partition(":")[2]
        used[name] = round(used.get(name, 0.0) + v - cpu0.get(k, 0.0), 2)
    steps = a.decode + 1  # one prefill step (the prompts fit one step) and the decode steps
    info = {"mode": mode, "ms_per_step": round(min(times) / steps * 1e3, 3), "runs_s": [round(t, 3) for t in times]}
    info["thread_cpu_s"] = {k: v for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v >= 0.01}
    info["watch"] = watched
    moves1 = migrations(threading.get_native_id())
    if moves0 is not None and moves1 is not None:  # the engine's thread moving between CPUs over the timed runs
        info["main_migrations"] = moves1 - moves0
    if placed is not None:
        info["placed"] = placed
    if capture:
        st = [r for r in llm.collective_rpc("hscapture_stats") if r][0]
        n = max(1, st["host_ns_steps"] - base["host_ns_steps"])
        info["host_us_per_step"] = {
            k.removeprefix("host_ns_"): round((v - base.get(k, 0)) / n / 1e3, 1)
            for k, v in st.items()
            if k.startswith("host_ns_") and k != "host_ns_steps"
        }
    print("CPU_DECODE " + json.dumps(info), flush=True)


def grown(ours: str, plain: str, top: int = 25) -> None:
    """The functions whose own time grew most from the plain profile to ours."""

    def load(p: str) -> dict[str, tuple[int, float]]:
        return {
            f"{f.split('site-packages/')[-1]}:{ln}({fn})": (nc, tt)
            for (f, ln, fn), (_, nc, tt, _, _) in pstats.Stats(p).stats.items()  # type: ignore[attr-defined]
        }

    o, p = load(ours), load(plain)
    rows = sorted(((o.get(k, (0, 0.0))[1] - p.get(k, (0, 0.0))[1], k) for k in set(o) | set(p)), reverse=True)
    for d, k in rows[:top]:
        print(f"  {d * 1e3:8.2f} ms  calls {o.get(k, (0, 0))[0]:6d} vs {p.get(k, (0, 0))[0]:6d}  {k[:150]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--repeat", type=int, default=2, help="the mode list this many times over")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=96)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--eager", action="store_true", help="enforce_eager: no torch.compile (as the H200's eager modes)")
    ap.add_argument(
        "--place",
        choices=("pinned", "apart"),
        help="after warm-up, the engine's thread on one CPU (pinned), and every other thread on other physical "
        "cores (apart): bench/placement.py",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--pstats", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        run(a.child, a.model, a.out, a, a.pstats)
        return 0
    modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown modes {bad}; expected some of {','.join(MODES)}")
    from hscapture.testing import tiny

    work = Path(tempfile.mkdtemp(prefix="hscpudec-"))
    model = str(tiny.build("llama", work / "model", seed=0))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    best: dict[str, float] = {}
    for rep in range(a.repeat):
        for m in modes:
            stats = str(work / f"{m}.pstats") if a.profile else None
            cmd = [sys.executable, __file__, "--child", m, "--model", model, "--out", str(work / f"out-{m}-{rep}")]
            cmd += ["--requests", str(a.requests), "--prompt", str(a.prompt), "--decode", str(a.decode)]
            cmd += ["--eager"] if a.eager else []
            cmd += ["--place", a.place] if a.place else []
            r = subprocess.run(cmd + (["--pstats", stats] if stats else []), env=env, capture_output=True, text=True)
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("CPU_DECODE ")]
            if r.returncode != 0 or not line:
                print(f"[{m}] failed (rc {r.returncode}):\n{r.stderr[-3000:]}", flush=True)
                return 1
            info = json.loads(line[-1].removeprefix("CPU_DECODE "))
            best[m] = min(best.get(m, float("inf")), info["ms_per_step"])
            print(
                f"[pass {rep + 1}] {m}: {info['ms_per_step']} ms/step (runs {info['runs_s']} s); threads' CPU s "
                f"{info['thread_cpu_s']}; gc [n, ms] and the step's calls [calls, minor faults, CPU ms] {info['watch']}; "
                f"engine thread's migrations "
                f"{info.get('main_migrations')}"
                + (f"; placed {info['placed']}" if "placed" in info else "")
                + (f"; hscapture host µs/step {info['host_us_per_step']}" if "host_us_per_step" in info else ""),
                flush=True,
            )
    if "plain" in best:
        print(
            "== best ms/step and × plain's step time: "
            + ", ".join(f"{m} {v} ({v / best['plain']:.2f}×)" for m, v in best.items())
        )
    if a.profile and "plain" in best:
        for m in modes:
            if m != "plain":
                print(f"== {m}: own time grown against plain (one generate, cProfile)")
                grown(str(work / f"{m}.pstats"), str(work / "plain.pstats"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
