"""Kill-and-resume at scale: N short prompts through `hscapture extract` on CPU with the tiny llama, once
uninterrupted and once killed with SIGKILL (driver and vLLM's processes) part-way and resumed with --resume.
The two outputs must hold the same set of files, every one passing `hscapture verify`; the states are compared
through the manifests' checksums (and, where a checksum differs, by value). The resumed run is shown under a
pseudo-terminal (`script`), so its progress bar is captured as a user sees it; the uninterrupted run's stdout is
not a terminal, so it shows the plain log lines.

    .venv/bin/python bench/kill_resume.py [--prompts 10000] [--kill-at 0.4] [--work /tmp/research/issue6] \
        [--log /tmp/research/issue6-run.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

CMD = [sys.executable, "-m", "hscapture.cli.main"]


def extract_args(model, inp, out, *extra):
    return CMD + [
        "extract",
        "--model",
        str(model),
        "--input",
        str(inp),
        "--out",
        str(out),
        "--layers",
        "1,2,4",
        "--convention",
        "before",
        "--dtype",
        "float32",
        "--store-dtype",
        "bfloat16",
        "--max-num-batched-tokens",
        "2048",
        "--log-every",
        "10",
        *extra,
    ]


def count(out: Path) -> int:
    hs = out / "hidden_states"
    return sum(1 for f in hs.iterdir() if f.name.startswith("hs_")) if hs.is_dir() else 0


def checksums(out: Path) -> dict[int, str]:
    return {s["index"]: s["checksum"] for s in json.loads((out / "manifest.json").read_text())["samples"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=10000)
    ap.add_argument("--min-len", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=40)
    ap.add_argument("--kill-at", type=float, default=0.4, help="fraction of files written when the kill comes")
    ap.add_argument("--work", default="/tmp/research/issue6")
    ap.add_argument("--log", default="/tmp/research/issue6-run.txt")
    args = ap.parse_args()

    from hscapture.cli.demo import cache_dir
    from hscapture.testing import tiny

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log = open(args.log, "w")

    def say(text: str) -> None:
        print(text, flush=True)
        log.write(text + "\n")
        log.flush()

    model = tiny.build("llama", cache_dir() / "models" / "tiny-llama", seed=0)
    rng = random.Random(6)
    inp = work / "prompts.jsonl"
    with inp.open("w") as f:
        for _ in range(args.prompts):
            f.write(
                json.dumps(
                    {
                        "token_ids": [
                            rng.randrange(4, tiny.VOCAB) for _ in range(rng.randint(args.min_len, args.max_len))
                        ]
                    }
                )
                + "\n"
            )
    say(
        f"# {args.prompts} prompts of {args.min_len}-{args.max_len} tokens, tiny llama ({model}), CPU, {os.cpu_count()} cores"
    )

    full, cut = work / "full", work / "cut"
    say(
        "\n## 1. uninterrupted run (stdout not a terminal: plain log lines)\n$ "
        + shlex.join(extract_args(model, inp, full)[2:])
    )
    t0 = time.time()
    r = subprocess.run(extract_args(model, inp, full), capture_output=True, text=True)
    say(r.stdout.rstrip())
    say(f"(exit {r.returncode}, {time.time() - t0:.0f} s wall)")
    if r.returncode:
        say(r.stderr[-3000:])
        return 1

    say(f"\n## 2. the same run, killed with SIGKILL (process group) at ~{args.kill_at:.0%} of the files")
    killed_log = open(work / "killed-run.log", "w")
    p = subprocess.Popen(
        extract_args(model, inp, cut), stdout=killed_log, stderr=subprocess.STDOUT, start_new_session=True
    )
    target = int(args.prompts * args.kill_at)
    while count(cut) < target and p.poll() is None:
        time.sleep(0.02)
    if p.poll() is not None:
        say(
            f"the run ended (exit {p.returncode}) before the kill; its output:\n"
            + (work / "killed-run.log").read_text()[-3000:]
        )
        return 1
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    partial = [f.name for f in (cut / "hidden_states").iterdir() if ".partial-" in f.name]
    say(
        f"killed with {count(cut)} of {args.prompts} files written, {len(partial)} partial (hidden) files, "
        f"manifest written: {(cut / 'manifest.json').exists()}"
    )

    say("\n## 3. resumed under a pseudo-terminal (what a user sees: the progress bar, then the report)")
    resume = shlex.join(extract_args(model, inp, cut, "--resume"))
    say("$ " + shlex.join(extract_args(model, inp, cut, "--resume")[2:]))
    t0 = time.time()
    # A 120x40 terminal (script's pseudo-terminal has no size of its own); vLLM's stderr chatter left out.
    r = subprocess.run(
        ["script", "-qec", "stty cols 120 rows 40; " + resume + " 2>/dev/null", "/dev/null"], capture_output=True
    )  # bytes: text mode would turn the bar's \r into \n
    (work / "resume-screen.raw").write_bytes(r.stdout)
    screen = r.stdout.decode(errors="replace").replace("\r\n", "\n")
    frames = [[ln for ln in x.splitlines() if "samples [" in ln][-1] for x in screen.split("\r") if "samples [" in x]
    say(f"progress bar: {len(frames)} frames drawn in place on one line; the first, a quarter, half way, the last:")
    for k in sorted({0, len(frames) // 4, len(frames) // 2, len(frames) - 1} if frames else ()):
        say("  " + frames[k])
    say(screen.split("\r")[-1].strip().split("\n", 1)[-1])
    say(f"(exit {r.returncode}, {time.time() - t0:.0f} s wall)")
    if r.returncode:
        return 1

    say("\n## 4. comparison")
    a, b = (
        sorted(p.name for p in (full / "hidden_states").iterdir()),
        sorted(p.name for p in (cut / "hidden_states").iterdir()),
    )
    same_files = a == b == sorted(f"hs_{i}.safetensors" for i in range(args.prompts))
    ca, cb = checksums(full), checksums(cut)
    differ = sorted(i for i in ca if ca[i] != cb.get(i))
    say(f"file sets equal (hs_0..hs_{args.prompts - 1}, nothing else): {same_files}")
    say(f"manifest checksums equal: {len(ca) - len(differ)} of {len(ca)}")
    values_ok = True
    if differ:
        from hscapture import load_sample

        worst = 0.0
        for i in differ:
            x = load_sample(full / "hidden_states" / f"hs_{i}.safetensors")["hidden_states"].float()
            y = load_sample(cut / "hidden_states" / f"hs_{i}.safetensors")["hidden_states"].float()
            worst = max(worst, float(((x - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-12)).max()))
        say(
            f"  the {len(differ)} differing samples (first {differ[:8]}): worst relative difference {worst:.2e} "
            "(a request batched differently on CPU; bf16 storage)"
        )
        values_ok = worst < 1e-2
    ok = same_files
    for out in (full, cut):
        v = subprocess.run(CMD + ["verify", str(out)], capture_output=True, text=True)
        say(f"$ hscapture verify {out}\n{v.stdout.rstrip()}")
        ok = ok and v.returncode == 0
    ok = ok and values_ok
    say(
        f"\nRESULT: {'FAIL' if not ok else 'PASS' if not differ else 'PASS (same files; some values differ within 1e-2)'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
