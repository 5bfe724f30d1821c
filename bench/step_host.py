"""The host cost of hscapture's step protocol, without an engine or a GPU: a real core session and WorkerCapture
driven by vLLM-shaped scheduler outputs (64 requests prefilled in one step, then decode steps of one token each,
prompt and response captured: `include_output_tokens`), for several layer counts. Prints µs per decode step in each
part of the protocol (begin, plan before the forward, the hooks, end), measured where they are spent
(`WorkerCapture.host_ns`), and how each grows with the layer count. The hooks' share includes copying the rows on
the CPU (`hidden` × layers × requests); with ``--device cuda`` the tensors are on the GPU and each hook is the
device path's launch, as in an eager GPU decode step (the host's cost of a hook without the engine around it).

    python bench/step_host.py [--requests 64] [--prompt 32] [--decode 128] [--hidden 4096] [--layers 4,16,32]
    python bench/step_host.py --profile     # cProfile of the decode steps' host work, top functions
    python bench/step_host.py --device cuda [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hscapture import _native  # noqa: E402
from hscapture.adapters.vllm_compat import RunnerOrder  # noqa: E402
from hscapture.capture.ranksync import RankSync  # noqa: E402
from hscapture.capture.worker_capture import WorkerCapture, run_step  # noqa: E402
from hscapture.config import CaptureConfig  # noqa: E402
from support import new_req, sched  # noqa: E402 - the suites' own vLLM-shaped fakes


class Runner:
    def __init__(self):
        self.input_batch = SimpleNamespace(num_reqs=0, req_ids=[])


def run(
    requests: int,
    prompt: int,
    decode: int,
    hidden: int,
    n_layers: int,
    root: Path,
    profile: bool,
    background: bool = True,
    device: str = "cpu",
    outputs: bool = True,
) -> dict:
    layers = list(range(1, n_layers + 1))
    total_layers = n_layers + 2
    out = {"kind": "staging", "root": str(root), "format": "file", "durable": False}
    session = _native.CaptureSession(
        layers, "after", total_layers, hidden, "bfloat16", "bfloat16", assemble=True, output=_native.Output(out)
    )
    if background:
        session.set_background(4)
    path = None
    if device == "cuda":  # as wiring.enable_device sets it up: one step in flight, pinned ring of 4 + 1
        session.enable_device(
            torch.cuda.current_device(), requests * prompt, 5 if background else 2, 1, False, requests
        )
        path = SimpleNamespace(kind="device", overlap=1, fp8=False)
    cfg = CaptureConfig(layers=tuple(layers), convention="after", out=str(root))
    runner = Runner()
    sync = RankSync(SimpleNamespace(size=1, rank=0), 0, None)
    cap = WorkerCapture(cfg, session, sync, RunnerOrder(runner), path=path)
    ids = [f"r{i}" for i in range(requests)]
    meta = SimpleNamespace(hscapture=True, outputs={})
    kv = {"kv_transfer_params": {"include_output_tokens": outputs}}
    states = [torch.randn(requests * prompt, hidden, dtype=torch.bfloat16, device=device) for _ in layers]
    residual = [torch.randn(requests * prompt, hidden, dtype=torch.bfloat16, device=device) for _ in layers]

    worker = SimpleNamespace(_hscapture=cap)

    def forward(so):  # what vLLM's execute_model does between hscapture's begin and end
        cap.before_forward()
        n = so.total_num_scheduled_tokens
        for slot in range(n_layers):
            cap.on_capture(slot, states[slot][:n], residual[slot][:n])

    def step(so, order):
        runner.input_batch.num_reqs, runner.input_batch.req_ids = len(order), list(order)
        run_step(worker, forward, so)

    new = []
    for i, rid in enumerate(ids):
        r = new_req(rid, [(7 * i + k) % 1000 + 4 for k in range(prompt)], None, max_tokens=decode + 1)
        r.sampling_params.extra_args = kv
        new.append(r)
    first = sched(new=new, n={rid: prompt for rid in ids})
    first.kv_connector_metadata = meta
    step(first, ids)
    for k in cap.host_ns:
        cap.host_ns[k] = 0
    base = session.stats()
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    for d in range(decode):
        so = sched(cached=[(rid, prompt + d) for rid in ids], n=dict.fromkeys(ids, 1))
        so.kv_connector_metadata = meta
        step(so, ids)
    if prof:
        prof.disable()
    st = session.stats()
    core = {k[3:]: (st[k] - base[k]) / decode / 1000 for k in st if k.startswith("ns_")}
    generated = [(7 * k) % 1000 + 4 for k in range(decode)]
    done = sched(finished=ids)
    done.kv_connector_metadata = SimpleNamespace(
        hscapture=True,
        outputs={rid: new[i].prompt_token_ids + generated for i, rid in enumerate(ids)} if outputs else {},
    )
    step(done, [])
    if device == "cuda":
        torch.cuda.synchronize()
    steps = max(1, cap.host_ns["steps"])
    row = {k: cap.host_ns[k] / steps / 1000 for k in ("begin", "before_forward", "hooks", "end")}
    cap.flush()
    session.finish()
    row["files"] = len(list(root.glob("*.safetensors")))
    row["core"] = core
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", default="4,16,32")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--prompt-only", action="store_true", help="prompt rows only: decode steps capture nothing")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the layers' tensors are")
    p.add_argument("--inline", action="store_true", help="scatter on the worker's thread (HSCAPTURE_ASSEMBLY=inline)")
    p.add_argument(
        "--busy-thread",
        action="store_true",
        help="another Python thread running throughout (as vLLM's engine has): each call that releases the "
        "interpreter's lock must win it back",
    )
    a = p.parse_args()
    where = ("inline" if a.inline else "background assembly") + (
        ", a busy Python thread beside" if a.busy_thread else ""
    )
    stop = threading.Event()
    if a.busy_thread:

        def spin() -> None:
            n = 0
            while not stop.is_set():
                n += 1

        threading.Thread(target=spin, daemon=True).start()
    print(
        f"{a.requests} requests × ({a.prompt} prompt + {a.decode} decode steps), hidden {a.hidden}, bf16, "
        f"{a.device.upper()}, {where}" + (", prompt rows only" if a.prompt_only else "")
    )
    print("layers | begin µs | plan µs | hooks µs (µs per layer) | end µs | files")
    for n in (int(x) for x in a.layers.split(",")):
        with tempfile.TemporaryDirectory() as d:
            r = run(
                a.requests,
                a.prompt,
                a.decode,
                a.hidden,
                n,
                Path(d),
                a.profile,
                not a.inline,
                a.device,
                not a.prompt_only,
            )
        print(
            f"{n:6d} | {r['begin']:8.1f} | {r['before_forward']:7.1f} | {r['hooks']:8.1f} ({r['hooks'] / n:5.1f}) | "
            f"{r['end']:6.1f} | {r['files']}"
        )
        print(
            "       the core's share, µs per decode step: "
            + ", ".join(f"{k} {v:.1f}" for k, v in r["core"].items() if v)
        )
    stop.set()


if __name__ == "__main__":
    main()
