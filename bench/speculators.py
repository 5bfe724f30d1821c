"""Benchmark: speculators' offline generator with its own worker extension vs on hscapture.

Both runs use the same unchanged driver (`spec_bench_driver.py`), model, prompts and settings, in one
invocation, alternating; prints tokens/s of each, their ratio, and peak memory (driver and worker
processes). Not a test: nothing here asserts a time.

    .venv/bin/python bench/speculators.py --model DIR [--prompts 64 --length 512 --batch 16 --tp 1 --rounds 2]

speculators must be importable: by default from .venv/speculators-0.4.0 (scripts/setup.sh installs it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(mode: str, args, prompts_file: Path) -> dict:
    cmd = (
        [sys.executable, "-m", "hscapture.cli.main", "run-speculators"]
        + (["--own-extension"] if mode == "speculators" else [])
        + [
            str(HERE / "spec_bench_driver.py"),
            args.model,
            str(prompts_file),
            str(args.tp),
            str(args.batch),
            args.layers,
        ]
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([args.speculators, os.environ.get("PYTHONPATH", "")]),
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    env.pop("HSCAPTURE_SPECULATORS", None)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"{mode} run failed:\n{r.stderr[-4000:]}")
    return json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--layers", default="0,1,2,3")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--speculators", default=str(Path(sys.prefix) / "speculators-0.4.0"))
    args = ap.parse_args()
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    rng = random.Random(0)
    prompts = [
        [rng.randrange(4, cfg["vocab_size"]) for _ in range(args.length)] for _ in range(args.prompts + args.batch)
    ]
    with tempfile.TemporaryDirectory() as d:
        pf = Path(d) / "prompts.json"
        pf.write_text(json.dumps(prompts))
        results: dict[str, list[dict]] = {"speculators": [], "hscapture": []}
        for _ in range(args.rounds):
            for mode in results:
                results[mode].append(run(mode, args, pf))
    print(
        f"model {args.model}, {args.prompts} prompts x {args.length} tokens, batch {args.batch}, TP {args.tp}, "
        f"layers {args.layers}, {args.rounds} rounds (best of each)"
    )
    best = {}
    for mode, rs in results.items():
        r = max(rs, key=lambda x: x["tokens"] / x["seconds"])
        best[mode] = r["tokens"] / r["seconds"]
        print(
            f"  {mode:12s} {best[mode]:10,.0f} tokens/s   peak RSS driver {max(x['peak_driver_rss'] for x in rs) / 2**20:7.0f} MiB, "
            f"largest worker {max(x['peak_worker_rss'] for x in rs) / 2**20:7.0f} MiB"
        )
    print(f"  ratio hscapture / speculators: {best['hscapture'] / best['speculators']:.3f}")


if __name__ == "__main__":
    main()
