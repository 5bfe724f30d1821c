"""The server face, side by side (run on the H200): `vllm serve` with each hidden-states path, driven by speculators
0.9.0's own, unchanged `generate-offline-data` client, against the same server without capture.

    python3 bench/serve.py --models llama8b,dsv3 --samples 512 --length 1024 --concurrency 32 --decode 128

Modes (each its own server: random weights, `--load-format dummy`, bf16, token-id prompts; eager unless said):
  plain            no capture; driven by this script's client (`POST /v1/completions`, `max_tokens=1`, the same
                   prompts and concurrency), since speculators' client needs a hidden-states path in every answer
  hscapture-file   hscapture's `HscaptureConnector`, `format: file` (bf16 per-request files)
  hscapture-fp8    the same, `format: fp8` (quantized on the GPU)
  hscapture-file-writeback, hscapture-file-fsync
                   `format: file` with `durable: "writeback"` (each file's data written back by its writer thread after
                   its lock is released) or `durable: true` (fsync before the rename), instead of the connector's default
  vllm-file        vLLM's `extract_hidden_states` with its `ExampleHiddenStatesConnector`
  vllm-fp8         vLLM's `extract_hidden_states` with hs_connectors' `FP8HiddenStatesConnector`
  plain-defaults   no capture, vLLM's defaults (compile, CUDA graphs, chunked prefill) and 4 API servers, as
                   speculators' launcher starts it; driven like `plain`
  launch-file, launch-fp8
                   speculators' launcher's arguments through `hscapture launch` (backend file or fp8): vLLM's
                   defaults, 4 API servers, hscapture's worker and connector; driven by `generate-offline-data`
  offline          no server: `hscapture extract` of the same prompts into the same disk (its defaults: bf16,
                   fsync per file), for the writer's GB/s beside the servers'
Each capture mode runs `generate-offline-data --concurrency C --max-retries 0 --fail-on-error` on a prepared dataset
of `--samples` random prompts, once on 2·C samples to warm up, then on all; the rate is taken from the first to the
last file the client wrote, and end to end from its first request (the client's own `Timing:` line: its imports and
dataset load excluded, as for `plain`). `--decode N` adds, on `plain` and `hscapture-file`, `--decode-requests`
requests of `--decode-prompt` tokens generating N tokens each (`ignore_eos`, concurrency 64), with hscapture
capturing prompt and response (`include_output_tokens`), each file read and checked.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import re
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
from gpu import LAYERS, SHAPES, disk_ceiling  # noqa: E402 - the benchmark's model shapes, shared

# `--smoke`: a tiny Llama (hidden 128, 4 layers) to try the whole run on a CPU build of vLLM.
SMOKE = {
    **{k: v for k, v in SHAPES["llama8b"].items() if k not in ("hidden_size", "intermediate_size")},
    **{"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4},
    **{"num_key_value_heads": 2, "vocab_size": 1024},
}
SPECULATORS = "import sys; from speculators.__main__ import app; sys.argv[0] = 'speculators'; app()"
CAPTURE_MODES = (
    "hscapture-file",
    "hscapture-fp8",
    "hscapture-file-writeback",
    "hscapture-file-fsync",
    "vllm-file",
    "vllm-fp8",
)
DURABLE = {"writeback": "writeback", "fsync": True}
# Modes with vLLM's defaults (compile, CUDA graphs, chunked prefill) and speculators' front end (4 API servers).
DEFAULTS_MODES = ("plain-defaults", "launch-file", "launch-fp8")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.loads(r.read())


def mode_args(mode: str, stage: Path, layers: list[int]) -> list[str]:
    """The server arguments of a mode beyond the common ones (`layers`: vLLM's own, `before`-convention ids)."""
    if mode == "plain":
        return []
    if mode == "plain-defaults":  # speculators' launcher's front end, without capture
        return ["--api-server-count", "4"]
    if mode.startswith("hscapture-"):
        kv = {
            "kv_connector": "HscaptureConnector",
            "kv_connector_module_path": "hscapture.connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(stage), "format": mode.split("-")[1]},
        }
        hs = {"hscapture": {"layers": layers, "convention": "before"}}
        if mode.count("-") == 2:
            hs["hscapture"]["durable"] = DURABLE[mode.split("-")[2]]
        return [
            "--worker-cls",
            "hscapture.worker.CaptureWorker",
            "--additional-config",
            json.dumps(hs),
            "--kv-transfer-config",
            json.dumps(kv),
        ]
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}},
    }
    kv = {"kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(stage)}}
    if mode == "vllm-file":
        kv["kv_connector"] = "ExampleHiddenStatesConnector"
    else:
        kv |= {
            "kv_connector": "FP8HiddenStatesConnector",
            "kv_connector_module_path": "hs_connectors.fp8_hidden_states_connector",
        }
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]


class Server:
    def __init__(self, model: Path, mode: str, stage: Path, layers: list[int], args, log: Path) -> None:
        self.mode, self.log = mode, log
        port = free_port()
        common = ["--port", str(port), "--host", "127.0.0.1", "--load-format", "dummy", "--dtype", "bfloat16"]
        longest = max(args.length, args.decode_prompt + args.decode if args.decode else 0)
        common += ["--skip-tokenizer-init", "--max-model-len", str(longest + 16)]
        common += ["--max-num-batched-tokens", str(args.batch_tokens), "--no-enable-prefix-caching"]
        if mode not in DEFAULTS_MODES:
            # Eager, chunked prefill off: vLLM 0.23 refuses its own hidden-states connector with chunked prefill, and
            # the same steps everywhere make these modes comparable (16 × 1,024 tokens fill a 16,384-token step).
            common += ["--enforce-eager", "--no-enable-chunked-prefill"]
        common += ["--gpu-memory-utilization", "0.85", *args.server_arg]
        if mode.startswith("launch-"):  # speculators' launcher's arguments, through `hscapture launch`
            cmd = [sys.executable, "-m", "hscapture.cli.main", "launch", str(model)]
            cmd += ["--hidden-states-backend", mode.split("-", 1)[1], "--hidden-states-path", str(stage)]
            cmd += ["--target-layer-ids", *map(str, layers), "--", *common]
        else:
            cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), *common]
            cmd += mode_args(mode, stage, layers)
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.base = f"http://127.0.0.1:{port}"
        self.model = str(model)
        deadline = time.time() + 600
        while True:
            try:
                urllib.request.urlopen(self.base + "/health", timeout=5)
                return
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.stop()
                    raise RuntimeError(f"[{mode}] the server did not start:\n" + log.read_text()[-3000:]) from None
                time.sleep(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def in_threads(n: int, items: list, one) -> list[float]:
    """Runs `one(i, item)` over `items` from `n` threads; returns each call's finish time (raises the first error)."""
    todo, done, errors, lock = list(enumerate(items)), [], [], threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not todo or errors:
                    return
                i, item = todo.pop(0)
            try:
                one(i, item)
                with lock:
                    done.append(time.perf_counter())
            except BaseException as e:  # noqa: BLE001 - raised below
                with lock:
                    errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sorted(done)


def rates(t0: float, finished: list[float], n: int) -> dict:
    """End-to-end samples/s (from `t0`) and steady samples/s (first to last finish)."""
    span = finished[-1] - finished[0] if len(finished) > 1 else float("nan")
    return {"n": n, "seconds": finished[-1] - t0, "end_to_end": n / (finished[-1] - t0), "steady": (n - 1) / span}


def drive_plain(server: Server, prompts: list[list[int]], concurrency: int) -> dict:
    url = server.base + "/v1/completions"
    one = lambda i, p: post(url, {"model": server.model, "prompt": p, "max_tokens": 1})  # noqa: E731
    in_threads(concurrency, prompts[: 2 * concurrency], one)
    t0 = time.perf_counter()
    return rates(t0, in_threads(concurrency, prompts, one), len(prompts))


def drive_speculators(server: Server, data: Path, out: Path, n: int, concurrency: int, log: Path) -> dict:
    """speculators' `generate-offline-data`, unchanged; file appearance times read by polling its output."""
    cmd = [sys.executable, "-c", SPECULATORS, "generate-offline-data", "--endpoint", server.base + "/v1"]
    cmd += [
        "--preprocessed-data",
        str(data),
        "--concurrency",
        str(concurrency),
        "--max-retries",
        "0",
        "--fail-on-error",
    ]
    subprocess.run(["rm", "-rf", str(out)])
    warm = subprocess.run(
        [*cmd, "--output", str(out) + "-warm", "--max-samples", str(2 * concurrency)], capture_output=True, text=True
    )
    if warm.returncode != 0:
        raise RuntimeError(f"[{server.mode}] speculators' client failed:\n{(warm.stdout + warm.stderr)[-3000:]}")
    subprocess.run(["rm", "-rf", str(out) + "-warm"])
    out.mkdir(parents=True)
    seen: dict[str, float] = {}
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            now = time.perf_counter()
            for name in os.listdir(out):
                if name.startswith("hs_") and name.endswith(".safetensors"):
                    seen.setdefault(name, now)
            time.sleep(0.02)

    watcher = threading.Thread(target=poll)
    t0 = time.perf_counter()
    watcher.start()
    with log.open("w") as f:
        r = subprocess.run([*cmd, "--output", str(out)], stdout=f, stderr=subprocess.STDOUT)
    stop.set()
    watcher.join()
    for name in os.listdir(out):  # any the last poll missed
        seen.setdefault(name, time.perf_counter())
    if r.returncode != 0 or len(seen) != n:
        raise RuntimeError(
            f"[{server.mode}] speculators' client: exit {r.returncode}, {len(seen)} of {n} files:\n"
            + log.read_text()[-3000:]
        )
    res = rates(t0, sorted(seen.values()), n)
    # End to end as the client counts it, from its first request (after its imports and the dataset's load, which
    # the figure from the launch includes): the same span `drive_plain` times.
    elapsed = client_elapsed(log.read_text(errors="replace"))
    if elapsed is None:
        raise RuntimeError(f"[{server.mode}] speculators' client printed no 'Timing: N s elapsed' line; see {log}")
    res["with_client_start"] = res["seconds"]
    res["seconds"], res["end_to_end"] = elapsed, n / elapsed
    res["bytes"] = sum((out / name).stat().st_size for name in seen)
    return res


def client_elapsed(text: str) -> float | None:
    """The seconds `generate-offline-data` reports from its first request to its last file written."""
    found = re.findall(r"Timing: ([0-9]+(?:\.[0-9]+)?)s elapsed", text)
    return float(found[-1]) if found else None


_OFFLINE = """
import json, sys
from hscapture.cli.extract import ExtractOptions, run_extract
model, prompts, out, layers = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3], json.loads(sys.argv[4])
kw = {"load_format": "dummy", "enable_chunked_prefill": False, "gpu_memory_utilization": 0.85}
rep = run_extract(ExtractOptions(model=model, prompts=prompts, out=out, convention="before", layers=layers,
                                 dtype="bfloat16", max_num_batched_tokens=int(sys.argv[5]), progress=False, llm_kwargs=kw))
print("OFFLINE " + json.dumps({"seconds": rep.seconds, "bytes": rep.bytes, "tokens": rep.tokens}), flush=True)
"""


def drive_offline(
    model: Path, prompts: list[list[int]], out: Path, layers: list[int], batch_tokens: int, log: Path
) -> dict:
    """`hscapture extract` of the prompts (its own engine, in this machine's disk): the offline writer's rate."""
    subprocess.run(["rm", "-rf", str(out)])
    out.parent.mkdir(parents=True, exist_ok=True)
    listing = out.parent / f"{out.name}-prompts.json"
    listing.write_text(json.dumps(prompts))
    cmd = [sys.executable, "-c", _OFFLINE, str(model), str(listing), str(out), json.dumps(layers), str(batch_tokens)]
    with log.open("w") as f:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("OFFLINE ")]
    if r.returncode != 0 or not line:
        raise RuntimeError(f"[offline] hscapture extract failed:\n{log.read_text()[-3000:]}")
    rep = json.loads(line[-1][len("OFFLINE ") :])
    n = len(prompts)
    rate = n / rep["seconds"]
    return {"n": n, "seconds": rep["seconds"], "end_to_end": rate, "steady": rate, "bytes": rep["bytes"]}


def consume(path: str, rows: int, n_layers: int) -> int:
    """A client's part: wait for the lock, check the header's shape, remove file and lock."""
    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
    data = Path(path).read_bytes()
    head = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    shape = head["hidden_states"]["shape"]
    assert shape[:2] == [rows, n_layers], (shape, rows)
    os.unlink(path)
    if os.path.exists(lock):
        os.unlink(lock)
    return len(data)


def drive_decode(server: Server, prompts: list[list[int]], new: int, capture: bool, n_layers: int) -> dict:
    url = server.base + "/v1/completions"

    def one(i: int, p: list[int]) -> None:
        body = {"model": server.model, "prompt": p, "max_tokens": new, "ignore_eos": True}
        if capture:
            body["kv_transfer_params"] = {"include_output_tokens": True}
        r = post(url, body)
        if capture:
            path = (r.get("kv_transfer_params") or {}).get("hidden_states_path")
            assert path, f"no hidden_states_path in {r.get('kv_transfer_params')}"
            consume(path, len(p) + new - 1, n_layers)  # the last token was sampled, never an input

    in_threads(64, prompts[:64], one)
    t0 = time.perf_counter()
    res = rates(t0, in_threads(64, prompts, one), len(prompts))
    res["tokens"] = sum(len(p) + new for p in prompts)
    return res


def prepared(path: Path, prompts: list[list[int]]) -> Path:
    import datasets

    if not path.exists():
        ds = datasets.Dataset.from_dict(
            {"input_ids": prompts, "loss_mask": [[1] * len(p) for p in prompts], "seq_len": [len(p) for p in prompts]}
        )
        ds.set_format(type="torch")
        ds.save_to_disk(str(path))
    return path


def run_model(name: str, args) -> None:
    out = Path(args.out)
    shape = SMOKE if args.smoke else SHAPES[name]
    model = out / f"model-{name}"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(shape, indent=1))
    # vLLM's (before) ids of the shared after-convention ids
    layers = [1, 2, 4] if args.smoke else [i + 1 for i in map(int, LAYERS[name].split(","))]
    rng = random.Random(0)
    prompts = [[rng.randrange(10, shape["vocab_size"]) for _ in range(args.length)] for _ in range(args.samples)]
    data = prepared(out / f"data-{name}-{args.samples}x{args.length}", prompts)
    dec = [
        [rng.randrange(10, shape["vocab_size"]) for _ in range(args.decode_prompt)] for _ in range(args.decode_requests)
    ]
    results: dict[str, dict] = {}
    for mode in args.modes.split(","):
        if mode == "offline":
            try:
                r = drive_offline(
                    model, prompts, out / f"offline-{name}", layers, args.batch_tokens, out / f"offline-{name}.log"
                )
            except RuntimeError as e:
                print(f"[{name}/{mode}] FAILED: {e}", flush=True)
                continue
            finally:
                subprocess.run(["rm", "-rf", str(out / f"offline-{name}")])
            results[mode] = r
            print(
                f"[{name}/{mode}] {r['steady']:.1f} samples/s ({r['steady'] * args.length:,.0f} tok/s, {r['seconds']:.1f} s "
                f"capture and files), {r['bytes'] / (r['n'] * args.length):,.0f} B/token, {r['bytes'] / r['seconds'] / 1e9:.2f} GB/s",
                flush=True,
            )
            continue
        stage = out / f"stage-{name}-{mode}"
        subprocess.run(["rm", "-rf", str(stage)])
        stage.mkdir(parents=True)
        t = time.perf_counter()
        try:
            server = Server(model, mode, stage, layers, args, out / f"serve-{name}-{mode}.log")
        except RuntimeError as e:
            print(f"[{name}/{mode}] FAILED: {e}", flush=True)
            continue
        started = time.perf_counter() - t
        try:
            if mode.startswith("plain"):
                r = drive_plain(server, prompts, args.concurrency)
            else:
                r = drive_speculators(
                    server,
                    data,
                    out / f"gen-{name}-{mode}",
                    args.samples,
                    args.concurrency,
                    out / f"gen-{name}-{mode}.log",
                )
            if args.decode and mode in ("plain", "hscapture-file"):
                r["decode"] = drive_decode(server, dec, args.decode, mode != "plain", len(layers))
        except (RuntimeError, AssertionError, OSError) as e:
            print(f"[{name}/{mode}] FAILED: {e}", flush=True)
            continue
        finally:
            server.stop()
            subprocess.run(["rm", "-rf", str(stage), str(out / f"gen-{name}-{mode}")])
        results[mode] = r
        tok = args.length
        extra = (
            f", {r['bytes'] / (r['n'] * tok):,.0f} B/token, {r['bytes'] / (r['n'] / r['steady']) / 1e9:.2f} GB/s"
            if "bytes" in r
            else ""
        )
        start_s = f", {r['with_client_start']:.1f} s with its start-up" if "with_client_start" in r else ""
        dec_s = ""
        if "decode" in r:
            d = r["decode"]
            dec_s = f"; decode {d['tokens'] / d['seconds']:,.0f} tok/s ({d['n']} × {args.decode_prompt}+{args.decode})"
        print(
            f"[{name}/{mode}] {r['steady']:.1f} samples/s steady ({r['steady'] * tok:,.0f} tok/s), "
            f"{r['end_to_end']:.1f} end to end ({r['seconds']:.1f} s{start_s}){extra}{dec_s}; server start {started:.0f} s",
            flush=True,
        )
    for plain in ("plain", "plain-defaults"):
        if plain not in results:
            continue
        base = results[plain]
        print(
            f"== {name} ({args.samples} × {args.length} tokens, concurrency {args.concurrency}), steady vs {plain}: "
            + ", ".join(f"{m} {r['steady'] / base['steady']:.3f}x" for m, r in results.items())
            + "; end to end: "
            + ", ".join(f"{m} {r['end_to_end'] / base['end_to_end']:.3f}x" for m, r in results.items()),
            flush=True,
        )
        if plain == "plain" and "decode" in base and "decode" in results.get("hscapture-file", {}):
            d0, d1 = base["decode"], results["hscapture-file"]["decode"]
            ratio = (d1["tokens"] / d1["seconds"]) / (d0["tokens"] / d0["seconds"])
            print(f"== {name} decode with include_output_tokens vs plain decode: {ratio:.3f}x", flush=True)


def main() -> None:
    # A time limit's SIGTERM unwinds (each server is stopped in a `finally`; they run in sessions of their own).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama8b,dsv3")
    ap.add_argument("--modes", default="plain,hscapture-file,hscapture-fp8,vllm-file,vllm-fp8")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--decode", type=int, default=0, help="generated tokens per request in the decode part (0: none)")
    ap.add_argument("--decode-requests", type=int, default=256)
    ap.add_argument("--decode-prompt", type=int, default=512)
    ap.add_argument("--out", default="/tmp/hsserve")
    ap.add_argument("--server-arg", action="append", default=[], help="one more argument for every server")
    ap.add_argument("--smoke", action="store_true", help="a tiny Llama instead of --models' shapes (a CPU try-out)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"disk write with fdatasync: {disk_ceiling(out):.2f} GB/s (under {out})", flush=True)
    for name in ["smoke"] if args.smoke else args.models.split(","):
        run_model(name, args)


if __name__ == "__main__":
    main()
