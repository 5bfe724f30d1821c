"""A run interrupted with Ctrl-C, resumed, killed with SIGKILL (engine processes included) and resumed again
ends with the same set of files as an uninterrupted run, every file whole and verified; no sample is written
twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import cli_extract, prompts

from hscapture import load_sample

pytestmark = pytest.mark.integration
CMD = [sys.executable, "-m", "hscapture.cli.main"]


def extract_args(model, inp, out, *extra):
    return cli_extract(model, inp, out, *extra)


def files(out):
    return sorted(p.name for p in (out / "hidden_states").iterdir())


def test_kill_and_resume_gives_the_uninterrupted_files(tmp_path, tiny_model):
    model = tiny_model("llama")
    import random

    rng = random.Random(5)
    ps = prompts(41, lengths=[rng.randint(20, 110) for _ in range(48)])
    inp = tmp_path / "p.jsonl"
    inp.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in ps))

    full = tmp_path / "full"
    r = subprocess.run(extract_args(model, inp, full), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]

    cut = tmp_path / "cut"
    # Interrupted twice at different points: Ctrl-C (SIGINT to the process group, as a terminal sends it),
    # then, resumed, SIGKILL of the driver and vLLM's engine and worker processes.
    killed_with = 0
    for sig, extra, at in ((signal.SIGINT, (), 5), (signal.SIGKILL, ("--resume",), 20)):
        p = subprocess.Popen(
            extract_args(model, inp, cut, *extra),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.time() + 240
        while time.time() < deadline and p.poll() is None:
            hs = cut / "hidden_states"
            if hs.is_dir() and sum(1 for f in hs.iterdir() if f.name.startswith("hs_")) >= at:
                break
            time.sleep(0.05)
        os.killpg(p.pid, sig)
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            pytest.fail(f"the run did not stop within 120 s of {sig.name}")
        now = len([f for f in files(cut) if f.startswith("hs_")])
        assert killed_with < now < len(ps), f"{sig.name} came at {now} of {len(ps)} files (before: {killed_with})"
        assert not any(".partial" in f for f in files(cut)) or sig == signal.SIGKILL
        killed_with = now
        if sig == signal.SIGINT:
            again = subprocess.run(extract_args(model, inp, cut), capture_output=True, text=True)
            assert again.returncode == 2 and "--resume" in again.stderr, "a re-run without --resume is refused"

    r = subprocess.run(extract_args(model, inp, cut, "--resume"), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "finished earlier, kept" in r.stdout
    assert files(cut) == files(full) == sorted(f"hs_{i}.safetensors" for i in range(len(ps)))
    for i, prompt in enumerate(ps):
        a = load_sample(cut / "hidden_states" / f"hs_{i}.safetensors")
        b = load_sample(full / "hidden_states" / f"hs_{i}.safetensors")
        assert a["token_ids"].tolist() == prompt == b["token_ids"].tolist()
        assert torch.allclose(a["hidden_states"], b["hidden_states"], rtol=1e-4, atol=1e-5)
    for out in (cut, full):
        v = subprocess.run(CMD + ["verify", str(out)], capture_output=True, text=True)
        assert v.returncode == 0 and "OK" in v.stdout, v.stdout + v.stderr
    # Damage is found by verify.
    f = cut / "hidden_states" / "hs_3.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    v = subprocess.run(CMD + ["verify", str(cut)], capture_output=True, text=True)
    assert v.returncode == 1 and "sample 3" in v.stdout and "truncated" in v.stdout


def test_a_capture_summed_before_the_rule_was_recorded_is_not_continued_as_hidden(tmp_path, tiny_model):
    """Exaone 4's layers return the stream whole (adapters/layer_output.py). A capture of it by an hscapture that
    summed what they return, whose ledger has no rule (read as `sum`), is not continued with files of the other rule:
    the workers refuse its journal, naming the difference. A fresh capture's manifest records the rule."""
    model = tiny_model("exaone4", "float32")
    ps = prompts(7, lengths=(5, 40, 12))
    inp = tmp_path / "p.jsonl"
    inp.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in ps[:2]))
    out = tmp_path / "out"
    r = subprocess.run(extract_args(model, inp, out), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "manifest.json").read_text())["layer_output"] == "hidden"
    # As an earlier hscapture left it: no rule in the journal's identity line (nor in the manifest).
    journal = out / "records.jsonl"
    text = journal.read_text()
    assert ',"layer_output":"hidden"' in text
    journal.write_text(text.replace(',"layer_output":"hidden"', "", 1))
    (out / "manifest.json").unlink()
    inp.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in ps))
    r = subprocess.run(extract_args(model, inp, out, "--resume"), capture_output=True, text=True)
    assert r.returncode != 0
    assert "layer output: sum vs hidden" in r.stderr, r.stderr[-3000:]
