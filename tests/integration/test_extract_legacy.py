"""--format legacy through real vLLM: the workers write data_{i}.pt themselves; killed with SIGKILL mid-run and
resumed, every data_{i}.pt is whole, the finished ones are kept (not rewritten), the rest captured; verify
passes; the layer list must end at the final layer (speculators 0.3/0.4 take the last one as the verifier's)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.integration
CMD = [sys.executable, "-m", "hscapture.cli.main"]


def args(model, inp, out, layers="1,3", *extra):
    return CMD + [
        "extract",
        "--model",
        model,
        "--input",
        str(inp),
        "--out",
        str(out),
        "--layers",
        layers,
        "--convention",
        "after",
        "--dtype",
        "float32",
        "--store-dtype",
        "bfloat16",
        "--format",
        "legacy",
        "--max-num-batched-tokens",
        "32",
        "--log-every",
        "1",
        *extra,
    ]


def data_files(out):
    return sorted(p.name for p in out.iterdir() if p.name.startswith("data_") and p.name.endswith(".pt"))


def test_legacy_killed_and_resumed(tmp_path, tiny_model):
    model = tiny_model("llama")
    rng = random.Random(11)
    ps = [[rng.randrange(4, 1024) for _ in range(rng.randint(8, 60))] for _ in range(150)]
    masks = {i: [int(rng.random() < 0.5) for _ in ps[i]] for i in range(0, 150, 3)}
    inp = tmp_path / "p.jsonl"
    inp.write_text(
        "".join(
            json.dumps({"token_ids": p, **({"loss_mask": masks[i]} if i in masks else {})}) + "\n"
            for i, p in enumerate(ps)
        )
    )
    out = tmp_path / "out"

    r = subprocess.run(args(model, inp, out, "1,2"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "ConfigError" in r.stderr and "add 3 to --layers" in r.stderr, r.stderr

    p = subprocess.Popen(
        args(model, inp, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )

    def vouched():  # the files the journal vouches for: what a resume keeps (a file is written before its line)
        journal = out / "records.jsonl"
        lines = journal.read_text().splitlines()[1:] if journal.is_file() else []
        return {json.loads(x)["file"] for x in lines if x.strip().endswith("}")}

    deadline = time.time() + 300
    while time.time() < deadline and len(vouched()) < 5:
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    vouched = vouched()
    kept = {n: os.stat(out / n).st_ino for n in data_files(out) if n in vouched}
    assert 5 <= len(kept) < len(ps), f"the kill came at {len(kept)} of {len(ps)} files"
    assert not (out / "manifest.json").exists() and not (out / "sample_lengths.json").exists()

    r = subprocess.run(args(model, inp, out, "1,3", "--resume"), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # Every file its journal line vouches for is kept; the rest is captured now.
    assert f"(+{len(kept)} finished earlier, kept)" in r.stdout, r.stdout
    assert "checks      resume:" in r.stdout
    assert data_files(out) == sorted(f"data_{i}.pt" for i in range(len(ps)))
    assert all(os.stat(out / n).st_ino == ino for n, ino in kept.items()), "finished files are kept, not rewritten"
    assert not [n for n in os.listdir(out) if ".partial-" in n]
    lengths = json.loads((out / "sample_lengths.json").read_text())
    assert lengths == {str(i): len(p) for i, p in enumerate(ps)}
    for i, prompt in enumerate(ps):
        d = torch.load(out / f"data_{i}.pt", weights_only=True)
        assert d["input_ids"].tolist() == prompt
        assert d["loss_mask"].tolist() == masks.get(i, [1] * len(prompt))
        assert len(d["hidden_states"]) == 2 and tuple(d["hidden_states"][0].shape) == (len(prompt), 128)
    v = subprocess.run(CMD + ["verify", str(out)], capture_output=True, text=True)
    assert v.returncode == 0 and "legacy" in v.stdout and "OK" in v.stdout, v.stdout
