"""The KV-connector face under load (run on the H200 with vLLM 0.23): `vllm serve` with hscapture's connector,
driven the way speculators 0.9.0's `generate-offline-data` drives it, against the same server without capture.

    python3 bench/connector.py --model llama8b --modes plain,file,fp8 --prompts 128 --length 1024 --concurrency 32

Each mode starts its own server (random weights, `--load-format dummy`, bf16, eager, `--skip-tokenizer-init`,
token-id prompts) and sends every prompt as `POST /v1/completions` with `max_tokens=1` from `--concurrency`
threads. With capture, each thread then does what speculators' client does: waits for the file's lock (`flock`),
reads the file, checks its `token_ids` equal the prompt and its shape, and removes file and lock (every 8th file
is also checked finite, dequantized for fp8). Prints tokens/s per mode, each ratio to `plain`, and bytes/token.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gpu import LAYERS, SHAPES  # noqa: E402 - the benchmark's model shapes, shared


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def serve(model: Path, mode: str, stage: Path, layers: list[int], batch_tokens: int, length: int, log: Path):
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--port", str(port)]
    cmd += ["--host", "127.0.0.1", "--load-format", "dummy", "--dtype", "bfloat16", "--enforce-eager"]
    cmd += ["--skip-tokenizer-init", "--max-model-len", str(length + 16), "--max-num-batched-tokens", str(batch_tokens)]
    cmd += ["--no-enable-prefix-caching", "--gpu-memory-utilization", "0.85"]
    if mode != "plain":
        cmd += ["--worker-cls", "hscapture.worker.CaptureWorker"]
        cmd += ["--additional-config", json.dumps({"hscapture": {"layers": layers, "convention": "before"}})]
        extra = {"shared_storage_path": str(stage), "format": mode}
        kv = {"kv_connector": "HscaptureConnector", "kv_connector_module_path": "hscapture.connector"}
        cmd += [
            "--kv-transfer-config",
            json.dumps({**kv, "kv_role": "kv_producer", "kv_connector_extra_config": extra}),
        ]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        try:
            urllib.request.urlopen(base + "/health", timeout=5)
            return proc, base
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                stop(proc)
                raise SystemExit(f"[{mode}] the server did not start:\n" + log.read_text()[-3000:]) from None
            time.sleep(2)


def stop(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def consume(path: str, prompt: list[int], n_layers: int, hidden: int, full: bool) -> int:
    """What speculators' client does with a file: wait for its lock, read it, check it, take it away."""
    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
    data = Path(path).read_bytes()
    head = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    hs = head["hidden_states"]
    assert hs["shape"] == [len(prompt), n_layers, hidden], (hs["shape"], len(prompt))
    if full:
        import torch
        from safetensors.torch import load

        t = load(data)
        assert t["token_ids"].tolist() == prompt, "token ids differ from the prompt"
        x = t["hidden_states"]
        if "hidden_states_scales" in t:
            x = x.to(torch.bfloat16) * t["hidden_states_scales"].to(torch.bfloat16)
        assert bool(torch.isfinite(x).all()), "non-finite states"
    os.unlink(path)
    if os.path.exists(lock):
        os.unlink(lock)
    return len(data)


def run_mode(args, model: Path, mode: str, prompts: list[list[int]], layers: list[int], hidden: int) -> dict:
    stage = Path(args.out) / f"stage-{mode}"
    stage.mkdir(parents=True, exist_ok=True)
    proc, base = serve(model, mode, stage, layers, args.batch_tokens, args.length, Path(args.out) / f"serve-{mode}.log")
    try:
        warm = prompts[: args.concurrency]
        results: dict[str, int] = {"bytes": 0, "checked": 0}
        lock = threading.Lock()

        def one(i: int, p: list[int]) -> None:
            body = post(base + "/v1/completions", {"model": str(model), "prompt": p, "max_tokens": 1})
            if mode == "plain":
                return
            path = (body.get("kv_transfer_params") or {}).get("hidden_states_path")
            assert path, f"no hidden_states_path in {body}"
            n = consume(path, p, len(layers), hidden, full=i % 8 == 0)
            with lock:
                results["bytes"] += n
                results["checked"] += int(i % 8 == 0)

        def drive(batch: list[list[int]]) -> float:
            todo = list(enumerate(batch))
            errors: list[BaseException] = []

            def worker() -> None:
                while True:
                    with lock:
                        if not todo or errors:
                            return
                        i, p = todo.pop(0)
                    try:
                        one(i, p)
                    except BaseException as e:  # noqa: BLE001 - reported below
                        with lock:
                            errors.append(e)

            t = time.perf_counter()
            threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            if errors:
                raise errors[0]
            return time.perf_counter() - t

        drive(warm)
        results["bytes"] = results["checked"] = 0
        seconds = min(drive(prompts) for _ in range(args.rounds))
        return {"mode": mode, "tokens": len(prompts) * args.length, "seconds": seconds, **results}
    finally:
        stop(proc)


def run_llm(args, model: Path, mode: str, prompts: list[list[int]], layers: list[int], hidden: int) -> dict:
    """The same contract through `LLM.generate` (for machines without vLLM's HTTP server): each output's
    `kv_transfer_params` names the file, consumed as the client does, after the batch."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    stage = Path(args.out) / f"stage-{mode}"
    stage.mkdir(parents=True, exist_ok=True)
    kw = dict(model=str(model), load_format="dummy", dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True)
    kw |= dict(max_model_len=args.length + 16, max_num_batched_tokens=args.batch_tokens, enable_prefix_caching=False)
    if mode != "plain":
        kw["worker_cls"] = "hscapture.worker.CaptureWorker"
        kw["additional_config"] = {"hscapture": {"layers": layers, "convention": "before"}}
        extra = {"shared_storage_path": str(stage), "format": mode}
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="HscaptureConnector",
            kv_connector_module_path="hscapture.connector",
            kv_role="kv_producer",
            kv_connector_extra_config=extra,
        )
    llm = LLM(**kw)
    sp = SamplingParams(max_tokens=1, detokenize=False)
    results = {"bytes": 0, "checked": 0}

    def once(batch) -> float:
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
        if mode != "plain":
            for i, o in enumerate(outs):
                path = (o.kv_transfer_params or {}).get("hidden_states_path")
                assert path, f"no hidden_states_path for output {i}"
                results["bytes"] += consume(path, list(o.prompt_token_ids), len(layers), hidden, full=i % 8 == 0)
                results["checked"] += int(i % 8 == 0)
        return time.perf_counter() - t

    once(prompts[: args.concurrency])
    results["bytes"] = results["checked"] = 0
    seconds = min(once(prompts) for _ in range(args.rounds))
    return {"mode": mode, "tokens": len(prompts) * args.length, "seconds": seconds, **results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama8b", choices=sorted(SHAPES))
    ap.add_argument("--modes", default="plain,file,fp8")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default="/tmp/hsconnector")
    ap.add_argument("--driver", default="serve", choices=["serve", "llm"], help="vllm serve + HTTP, or LLM.generate")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # (llm driver) this process runs one mode
    args = ap.parse_args()
    shape = SHAPES[args.model]
    model = Path(args.out) / f"model-{args.model}"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(shape, indent=1))
    # vLLM's (before) ids of the benchmark's after-convention layers.
    layers = [i + 1 for i in map(int, LAYERS[args.model].split(","))]
    rng = random.Random(0)
    prompts = [[rng.randrange(10, shape["vocab_size"]) for _ in range(args.length)] for _ in range(args.prompts)]
    if args.one:
        print("RESULT " + json.dumps(run_llm(args, model, args.one, prompts, layers, shape["hidden_size"])), flush=True)
        return
    results = {}
    for mode in args.modes.split(","):
        if args.driver == "llm":  # each mode in its own process (a clean GPU)
            p = subprocess.run([sys.executable, *sys.argv, "--one", mode], capture_output=True, text=True)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if not line:
                print(f"[{args.model}/{mode}] FAILED:\n" + (p.stdout + p.stderr)[-3000:], flush=True)
                continue
            r = json.loads(line[-1][len("RESULT ") :])
        else:
            r = run_mode(args, model, mode, prompts, layers, shape["hidden_size"])
        results[mode] = r
        per = (
            f", {r['bytes'] / (r['tokens'] * args.rounds):,.0f} B/token, {r['checked']} files checked in full"
            if r["bytes"]
            else ""
        )
        print(f"[{args.model}/{mode}] {r['tokens'] / r['seconds']:,.0f} tok/s ({r['seconds']:.2f} s{per})", flush=True)
    if "plain" in results:
        base = results["plain"]["tokens"] / results["plain"]["seconds"]
        print(
            f"== {args.model} ({'vllm serve, concurrency ' + str(args.concurrency) if args.driver == 'serve' else 'LLM.generate'}): "
            + ", ".join(f"{m} {r['tokens'] / r['seconds'] / base:.3f}x" for m, r in results.items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
