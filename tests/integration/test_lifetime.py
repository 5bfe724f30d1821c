"""The driver and its engine live and die together (lifetime.py), through real vLLM on CPU:
- the engine process killed (as the OOM killer does): the driver fails within seconds with EngineDiedError naming
  the process and its signal, instead of waiting forever;
- the driver killed with SIGKILL: the engine and its workers die with it, no file appears after, and a new run
  takes the directory and finishes it;
- --overwrite removes nothing until the new run has started: a refused run leaves the earlier capture whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from helpers import cli_extract, prompts

pytestmark = pytest.mark.integration
CMD = [sys.executable, "-m", "hscapture.cli.main"]


def args(model, inp, out, *extra):
    return cli_extract(model, inp, out, "--log-every", "0", *extra)


def long_input(tmp_path, n=400):
    import random

    rng = random.Random(3)
    ps = prompts(17, lengths=[rng.randint(40, 120) for _ in range(n)])
    inp = tmp_path / "p.jsonl"
    inp.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in ps))
    return inp, ps


def files(out):
    d = out / "hidden_states"
    return sorted(p.name for p in d.iterdir() if p.name.startswith("hs_")) if d.is_dir() else []


def session(sid: int) -> list[tuple[int, str, str]]:
    """Every process of the session `sid` started (the driver's, with everything vLLM and hscapture started for it:
    the engine, its workers, multiprocessing's resource tracker), zombies included."""
    found = []
    for q in psutil.process_iter(["pid", "status", "cmdline"]):
        try:
            if os.getsid(q.pid) == sid:
                found.append((q.pid, q.info["status"], " ".join(q.info["cmdline"] or [])[:80]))
        except (OSError, psutil.Error):
            pass  # gone meanwhile
    return found


def wait_for_files(out, n, proc, limit=240):
    deadline = time.time() + limit
    while time.time() < deadline and proc.poll() is None and len(files(out)) < n:
        time.sleep(0.05)
    assert len(files(out)) >= n, f"the run wrote {len(files(out))} files before the deadline"


@pytest.mark.newest
def test_a_killed_engine_fails_the_driver_with_its_signal(tmp_path, tiny_model):
    inp, _ = long_input(tmp_path)
    out = tmp_path / "out"
    p = subprocess.Popen(
        args(tiny_model("llama"), inp, out),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for_files(out, 3, p)
        engines = [
            c for c in psutil.Process(p.pid).children() if c.is_running() and "tracker" not in " ".join(c.cmdline())
        ]  # not multiprocessing's helpers
        assert engines, "vLLM runs its engine in a process of its own"
        engines[0].send_signal(signal.SIGKILL)
        t = time.time()
        _, err = p.communicate(timeout=60)
        took = time.time() - t
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 2, err[-3000:]
    assert "EngineDiedError" in err and "was killed by SIGKILL" in err and f"pid {engines[0].pid}" in err, err[-3000:]
    assert took < 20, f"the driver took {took:.1f} s to notice"


@pytest.mark.parametrize("tp", [1, 2])
def test_a_killed_driver_takes_its_engine_along_and_writes_nothing_after(tmp_path, tiny_model, tp):
    """At TP=2 the engine runs a worker process per rank: they go too."""
    inp, ps = long_input(tmp_path)
    out = tmp_path / "out"
    model = tiny_model("llama")
    p = subprocess.Popen(
        args(model, inp, out, "--tp", str(tp)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_for_files(out, 20, p)
    started = session(p.pid)
    # the driver, vLLM's engine and multiprocessing's helper; at TP=2 one worker process per rank besides
    assert len(started) >= 3 + (2 if tp > 1 else 0), f"the driver's session: {started}"
    os.kill(p.pid, signal.SIGKILL)  # the driver alone, as a lost session or `kill -9` of it does
    p.wait()
    deadline = time.time() + 15
    while session(p.pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not session(p.pid), f"processes of the driver's session outlived it by 15 s: {session(p.pid)}"
    written = files(out)
    time.sleep(2)
    assert files(out) == written, "no file appears once the driver (and the directory's lock) is gone"
    r = subprocess.run(args(model, inp, out, "--resume", "--tp", str(tp)), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert files(out) == sorted(f"hs_{i}.safetensors" for i in range(len(ps)))


def test_overwrite_keeps_the_earlier_capture_until_the_new_run_has_started(tmp_path, tiny_model):
    model = tiny_model("llama")
    inp = tmp_path / "p.jsonl"
    inp.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts(5, lengths=(6, 9))))
    out = tmp_path / "out"
    assert subprocess.run(args(model, inp, out), capture_output=True, text=True).returncode == 0
    before = {n: (out / "hidden_states" / n).read_bytes() for n in files(out)}
    manifest = (out / "manifest.json").read_bytes()
    for extra, why in (
        (("--writer-threads", "0"), "--writer-threads must be an integer of at least 1"),
        (("--vllm-arg", "max_num_seqs=abc"), "refuses this value"),
        (("--vllm-arg", "gpu_memory_utilization=1.5"), ""),
    ):  # refused by vLLM itself, at its start
        r = subprocess.run(args(model, inp, out, "--overwrite", *extra), capture_output=True, text=True)
        assert r.returncode != 0 and why in r.stderr, r.stderr[-2000:]
        assert {n: (out / "hidden_states" / n).read_bytes() for n in files(out)} == before, extra
        assert (out / "manifest.json").read_bytes() == manifest and not (out / ".hscapture-replaced").exists()
    r = subprocess.run(
        args(model, inp, out, "--overwrite", "--store-dtype", "bfloat16"), capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((out / "manifest.json").read_text())["dtype"] == "bfloat16" and files(out) == sorted(before)
