"""Soak: many requests through one vLLM instance on CPU with a tiny model; after every batch the writer is
drained and the worker's resident memory recorded; at the end every file is verified.

    .venv/bin/python bench/soak.py --requests 20000 [--batch 1000] [--out /tmp/hscapture-soak]

Prints the resident-memory curve (MiB after each batch) and its growth from the first batch to the last.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--out", default="/tmp/hscapture-soak")
    args = ap.parse_args()
    from hscapture import _native, runtime_env
    from hscapture.adapters.vllm_compat import SAMPLE_KEY
    from hscapture.cli.demo import cache_dir
    from hscapture.cli.verify import run_verify
    from hscapture.testing import tiny

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    model = tiny.build("llama", cache_dir() / "models" / "tiny-llama", seed=0)
    runtime_env.apply(1)
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(model),
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=128,
        max_num_batched_tokens=512,
        worker_cls="hscapture.worker.CaptureWorker",
        disable_log_stats=True,
        additional_config={"hscapture": {"layers": [1, 3], "convention": "after", "out": str(out), "durable": False}},
    )
    rng = random.Random(0)
    curve, records, t0 = [], [], time.perf_counter()
    for start in range(0, args.requests, args.batch):
        n = min(args.batch, args.requests - start)
        ps = [{"prompt_token_ids": [rng.randrange(4, 1024) for _ in range(rng.randint(8, 64))]} for _ in range(n)]
        sp = [SamplingParams(max_tokens=1, detokenize=False, extra_args={SAMPLE_KEY: start + i}) for i in range(n)]
        llm.generate(ps, sp, use_tqdm=False)
        for r in llm.collective_rpc("hscapture_drain"):
            if r and r.get("writer"):
                records += r["records"]
        st = llm.collective_rpc("hscapture_stats")[0]
        curve.append(st["rss"] / 2**20)
        print(
            f"[soak] {start + n:6d} requests, {len(records)} files, worker RSS {curve[-1]:7.1f} MiB, "
            f"held {st.get('held_bytes', 0) / 2**20:.1f} MiB, {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    fin = [r for r in llm.collective_rpc("hscapture_finish") if r and r.get("writer")][0]
    records += fin["records"]
    w = fin
    manifest = {
        "format": "hscapture/1",
        "model": str(model),
        "layer_ids": w["layer_ids"],
        "convention": w["convention"],
        "dtype": w["dtype"],
        "hidden_size": w["hidden_size"],
        "num_hidden_layers": w["num_hidden_layers"],
        "tensor_parallel_size": 1,
        "samples": records,
    }
    _native.write_manifest(str(out / "manifest.json"), json.dumps(manifest))
    print(f"[soak] resident memory after each batch (MiB): {', '.join(f'{x:.0f}' for x in curve)}")
    print(f"[soak] growth first→last batch: {curve[-1] - curve[0]:+.1f} MiB; files {len(records)} of {args.requests}")
    sys.exit(run_verify(out) or (0 if len(records) == args.requests else 1))
