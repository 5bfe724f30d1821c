"""Hostile-client soak of the server face: `vllm serve` on CPU with hscapture's KV connector (files), a tiny model,
and clients that misbehave in every way a public port allows, for --minutes (10 by default). Not CI.

    .venv/bin/python bench/hostile_soak.py [--minutes 10] [--concurrency 4] [--out /tmp/hscapture-hostile]

Mixed load, each request drawn at random:
  normal       a prompt from a pool of 24; the client waits for the file's lock, reads it, removes it
  outputs      the same with ``include_output_tokens`` (8 generated tokens): prompt and response in the file
  aborted      a streamed request whose client closes the connection after the first chunk
  disconnected a client that sends the request and closes the socket before any answer
  long_id      an ``X-Request-Id`` of 3,000 characters
  colliding    ``X-Request-Id`` ``x/1`` and ``x_1`` (vLLM's random suffix on, as by default)
  wrong_typed  ``kv_transfer_params`` that is not an object, ``include_output_tokens: "yes"``, and hscapture's
               driver keys of the wrong type through ``vllm_xargs``
  uncollected  a normal request whose client never collects its file (the staging directory's sweep must)

Counts at the end: requests per kind and how they ended; server restarts (the server's process must be the same
and answer ``/health`` throughout: 0); files collected and equal to hscapture's offline capture of the same prompt
(within float32 noise: steps are composed differently); files left in the staging directory once the collect
time (HSCAPTURE_STAGING_COLLECT_S, 10 s here) and a sweep (30 s) passed (must be 0); the server's resident memory
(API server and engine) at start and end.
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
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

LAYERS = [1, 2, 4]


def rss_mib(pid: int) -> float:
    """Resident memory of a process and its descendants (MiB)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            pass
    return total / 1024


class Client:
    def __init__(self, base: str, model: str, stage: Path, reference: dict, tol: float) -> None:
        self.base, self.model, self.stage, self.reference, self.tol = base, model, stage, reference, tol
        self.counts: Counter = Counter()
        self.worst = 0.0
        self.lock = threading.Lock()

    def count(self, kind: str, how: str) -> None:
        with self.lock:
            self.counts[(kind, how)] += 1

    def post(self, body: dict, headers: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
        req = urllib.request.Request(
            self.base + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, {"error": e.read().decode(errors="replace")[:300]}

    def collect(self, kind: str, path: str, want_ids: list[int], prompt: tuple[int, ...]) -> None:
        """As speculators' client: wait for the lock (10 s, its own timeout), read, remove."""
        from safetensors.torch import load_file

        from hscapture.testing.compare import compare

        lock = path + ".lock"
        deadline = time.time() + 10
        try:
            with open(lock, "rb") as f:
                while True:
                    try:
                        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.time() > deadline:
                            self.count(kind, "lock timeout")
                            return
                        time.sleep(0.01)
        except FileNotFoundError:
            pass  # the lock is gone: the file is in place, or failed
        if not os.path.exists(path):
            self.count(kind, "no file")
            return
        t = load_file(path)
        os.unlink(path)
        if os.path.exists(lock):
            os.unlink(lock)
        if t["token_ids"].tolist() != want_ids:
            self.count(kind, "WRONG TOKENS")
            return
        ref = self.reference.get(prompt)
        if ref is not None:
            rows = len(prompt)
            cmp = compare([t["hidden_states"][:rows]], [ref])
            with self.lock:
                self.worst = max(self.worst, cmp.worst)
            if not cmp.ok(self.tol):
                self.count(kind, "WRONG STATES")
                return
        self.count(kind, "file ok")

    def one(self, rng: random.Random, pool: list[list[int]]) -> None:
        kind = rng.choice(
            ["normal"] * 4
            + ["outputs"] * 2
            + ["aborted", "disconnected", "long_id", "colliding", "wrong_typed"]
            + ["uncollected"]
        )
        prompt = rng.choice(pool)
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1}
        try:
            if kind in ("normal", "uncollected", "long_id", "colliding", "outputs"):
                headers = {}
                if kind == "long_id":
                    headers["X-Request-Id"] = "".join(rng.choice("ab/ _-é%") for _ in range(3000))
                if kind == "colliding":
                    headers["X-Request-Id"] = rng.choice(["x/1", "x_1"])
                if kind == "outputs":
                    body |= {"max_tokens": 8, "kv_transfer_params": {"include_output_tokens": True}}
                    body |= {"ignore_eos": True, "temperature": 0.0, "return_token_ids": True}
                status, out = self.post(body, headers)
                if status != 200:
                    self.count(kind, f"HTTP {status}")
                    return
                path = (out.get("kv_transfer_params") or {}).get("hidden_states_path")
                if not path:
                    self.count(kind, "no path")
                    return
                if kind == "uncollected":
                    self.count(kind, "left")
                    return
                want = list(prompt)
                if kind == "outputs":
                    gen = out["choices"][0].get("token_ids") or []
                    want = list(prompt) + list(gen)[:-1] if gen else None
                self.collect(kind, path, want if want is not None else [], tuple(prompt))
            elif kind == "wrong_typed":
                junk = rng.choice(
                    [
                        {"kv_transfer_params": "junk"},
                        {"kv_transfer_params": {"include_output_tokens": "yes"}},
                        {"vllm_xargs": {"hscapture_sample": "zero"}},
                        {"vllm_xargs": {"hscapture_loss_mask": "0101"}},
                    ]
                )
                status, out = self.post(body | junk)
                if status != 200:
                    self.count(kind, f"refused {status}")  # the request fails itself: fine
                    return
                path = (out.get("kv_transfer_params") or {}).get("hidden_states_path")
                if path:
                    self.collect(kind, path, list(prompt), tuple(prompt))
                else:
                    self.count(kind, "no path")
            elif kind == "aborted":
                req = urllib.request.Request(
                    self.base + "/v1/completions",
                    data=json.dumps(body | {"stream": True, "max_tokens": 64, "ignore_eos": True}).encode(),
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(req, timeout=60) as r:
                    r.readline()  # the first chunk, then the client goes away
                self.count(kind, "closed after first chunk")
            else:  # disconnected
                host, port = self.base.removeprefix("http://").split(":")
                payload = json.dumps(body | {"max_tokens": 32, "ignore_eos": True}).encode()
                with socket.create_connection((host, int(port)), timeout=10) as s:
                    s.sendall(
                        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                        + payload
                    )
                self.count(kind, "closed before the answer")
        except Exception as e:  # noqa: BLE001 - a client-side failure is counted, the soak goes on
            self.count(kind, f"client error {type(e).__name__}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--out", default="/tmp/hscapture-hostile")
    args = ap.parse_args()
    import shutil

    from hscapture import load_sample, runtime_env
    from hscapture.cli.demo import cache_dir
    from hscapture.cli.extract import ExtractOptions, run_extract
    from hscapture.testing import tiny

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    stage = out / "stage"
    stage.mkdir(parents=True)
    model = str(tiny.build("llama", cache_dir() / "models" / "tiny-llama-float32-soak", seed=0, dtype="float32"))
    rng = random.Random(3)
    pool = [[rng.randrange(4, 1000) for _ in range(rng.randint(3, 60))] for _ in range(24)]
    # The reference: hscapture's offline capture of the pool, one request per step.
    rep = run_extract(
        ExtractOptions(
            model=model,
            prompts=pool,
            out=str(out / "offline"),
            convention="before",
            layers=LAYERS,
            dtype="float32",
            max_model_len=128,
            progress=False,
            llm_kwargs={"max_num_seqs": 1},
        )
    )
    assert rep.layer_ids == LAYERS
    reference = {
        tuple(p): load_sample(out / "offline" / "hidden_states" / f"hs_{i}.safetensors")["hidden_states"]
        for i, p in enumerate(pool)
    }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kv = {
        "kv_connector": "HscaptureConnector",
        "kv_connector_module_path": "hscapture.connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(stage), "format": "file"},
    }
    cmd = [str(Path(sys.executable).with_name("vllm")), "serve", model, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--dtype", "float32", "--enforce-eager", "--max-model-len", "128", "--max-num-batched-tokens", "64"]
    cmd += ["--worker-cls", "hscapture.worker.CaptureWorker", "--kv-transfer-config", json.dumps(kv)]
    cmd += ["--additional-config", json.dumps({"hscapture": {"layers": LAYERS, "convention": "before"}})]
    env = {
        **os.environ,
        **runtime_env.cpu_defaults(1),
        "VLLM_SLEEP_WHEN_IDLE": "1",
        "HSCAPTURE_STAGING_COLLECT_S": "10",
    }
    log = (out / "server.log").open("w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            urllib.request.urlopen(base + "/health", timeout=30)
            return True
        except OSError:
            return False

    try:
        deadline = time.time() + 300
        while not healthy():
            if server.poll() is not None or time.time() > deadline:
                raise SystemExit("the server did not start: see " + str(out / "server.log"))
            time.sleep(1)
        rss0 = rss_mib(server.pid)
        client = Client(base, model, stage, reference, tol=1e-3)
        stop = time.time() + args.minutes * 60
        down = []

        def worker(seed: int) -> None:
            r = random.Random(seed)
            while time.time() < stop and not down:
                client.one(r, pool)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(args.concurrency)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(5)
            if server.poll() is not None or not healthy():
                down.append(time.time())
        for t in threads:
            t.join()
        rss1 = rss_mib(server.pid)
        time.sleep(10 + 35)  # the collect time, then a sweep
        healthy()  # a request: sweeps run at step boundaries
        status, probe = client.post({"model": model, "prompt": pool[0], "max_tokens": 1})
        if status == 200:  # its own file is collected like any other
            client.collect("probe", probe["kv_transfer_params"]["hidden_states_path"], list(pool[0]), tuple(pool[0]))
        time.sleep(2)
        left = sorted(os.listdir(stage))
        restarts = int(server.poll() is not None or bool(down))
        total = sum(client.counts.values())
        print(f"hostile soak: {args.minutes:g} min, concurrency {args.concurrency}, {total} requests")
        for kind in sorted({k for k, _ in client.counts}):
            parts = ", ".join(f"{how} {n}" for (k, how), n in sorted(client.counts.items()) if k == kind)
            print(f"  {kind}: {parts}")
        print(f"server restarts or outages: {restarts}")
        print(f"worst relative error of a collected file vs the offline capture: {client.worst:.2e}")
        print(f"files left in the staging directory after the collect time and a sweep: {len(left)} {left[:5]}")
        print(f"server resident memory (API server + engine): {rss0:.0f} MiB at start, {rss1:.0f} MiB at the end")
        must_collect = ("normal", "outputs", "long_id", "colliding")
        bad = [
            k
            for k in client.counts
            if (k[0] in must_collect and k[1] != "file ok") or k[1].startswith(("WRONG", "HTTP 5", "refused 5"))
        ]
        ok = restarts == 0 and not left and not bad
        print("HOSTILE_SOAK " + ("PASS" if ok else f"FAIL {bad}"))
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
        log.close()


if __name__ == "__main__":
    main()
