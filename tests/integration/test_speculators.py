"""speculators' offline generator, unchanged, on hscapture (issue: the speculators pipeline).

- parity: speculators 0.4.0 with its own extension and with hscapture give identical tensors (TP 1 and 2,
  two batches of several prompts, chunked prefill forced);
- the seed scenario: speculators 0.3.0 on vLLM 0.16 returns 4 tensors of [L, H] per sample, identical to
  what speculators 0.4.0's own extension captures for the same batches, where it used to fail before
  capture or keep only the first layer.

The generator loads the model with dtype="auto", which vLLM resolves to bfloat16 for a float32
checkpoint on CPU; both sides of each comparison therefore run the same bfloat16 model and must agree
exactly (both store round(hidden + residual) in the model dtype).
- without the unique-reply shim, 0.3.0's output is wrong (the shim is still needed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import prompts
from safetensors.torch import load_file

from support import SPECULATORS_REASON, speculators_generator_runs, speculators_path

pytestmark = [pytest.mark.integration, pytest.mark.skipif(not speculators_generator_runs(), reason=SPECULATORS_REASON)]
HERE = Path(__file__).resolve().parent
LAYERS = [0, 1, 2, 3]


def need(version: str) -> Path:
    p = speculators_path(version)
    if p is None:
        pytest.skip(f"speculators {version} is not installed (scripts/setup.sh installs it)")
    return p


def run_driver(tmp_path, spec: Path, model: str, ps, *, tp: int, own: bool, name: str, chunk: int = 32, env=None):
    pf = tmp_path / "prompts.json"
    pf.write_text(json.dumps(ps))
    out = tmp_path / f"{name}.safetensors"
    cmd = (
        [sys.executable, "-m", "hscapture.cli.main", "run-speculators"]
        + (["--own-extension"] if own else [])
        + [str(HERE / "spec_driver.py"), model, str(pf), str(out), str(tp), str(chunk), ",".join(map(str, LAYERS))]
    )
    e = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(spec), str(HERE), os.environ.get("PYTHONPATH", "")]),
        **(env or {}),
    }
    e.pop("HSCAPTURE_SPECULATORS", None)
    r = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=600)
    return r, out


def samples(path: Path, ps) -> list[dict]:
    t = load_file(str(path))
    half = len(ps) // 2
    out = []
    for i in range(len(ps)):
        b, j = (0, i) if i < half else (1, i - half)
        out.append(
            {"input_ids": t[f"b{b}_s{j}_input_ids"], "layers": [t[f"b{b}_s{j}_l{k}"] for k in range(len(LAYERS))]}
        )
    return out


@pytest.mark.newest
@pytest.mark.parametrize("tp", [1, 2])
def test_speculators_040_parity(tmp_path, tiny_model, tp):
    spec = need("0.4.0")
    model = tiny_model("llama", dtype="float32")  # the generator loads dtype="auto"; CPU attention needs float32
    ps = prompts(20 + tp, lengths=(37, 5, 64, 12, 50, 3))
    own, own_out = run_driver(tmp_path, spec, model, ps, tp=tp, own=True, name="own")
    assert own.returncode == 0, own.stderr[-4000:]
    ours, our_out = run_driver(tmp_path, spec, model, ps, tp=tp, own=False, name="hscapture")
    assert ours.returncode == 0, ours.stderr[-4000:]
    assert "speculators on hscapture" in ours.stderr and "hscapture: capturing after ids [0, 1, 2, 3]" in ours.stderr
    a, b = samples(own_out, ps), samples(our_out, ps)
    for p, x, y in zip(ps, a, b, strict=True):
        assert x["input_ids"].tolist() == y["input_ids"].tolist() == p
        for k in range(len(LAYERS)):
            assert x["layers"][k].shape == y["layers"][k].shape == (len(p), 128)
            assert torch.equal(x["layers"][k], y["layers"][k]), f"layer {LAYERS[k]} differs"


def test_speculators_030_seed_scenario(tmp_path, tiny_model):
    spec = need("0.3.0")
    model = tiny_model("llama", dtype="float32")
    ps = prompts(30, lengths=(37, 5, 64, 12))
    r, out = run_driver(tmp_path, spec, model, ps, tp=1, own=False, name="seed")
    assert r.returncode == 0, r.stderr[-4000:]
    for shim in (
        "scheduler_config_encoder_decoder",
        "prefix_caching_off",
        "kv_cache_config_kwargs",
        "scheduler_block_size",
        "unique_reply_list",
    ):
        assert shim in r.stderr, f"{shim} was not applied"
    got = samples(out, ps)
    for p, s in zip(ps, got, strict=True):
        assert len(s["layers"]) == 4 and all(h.shape == (len(p), 128) for h in s["layers"])
        assert s["input_ids"].tolist() == p
    # The same batches through speculators 0.4.0's own extension, with 0.3.0's step budget (8192 tokens).
    ref_run, ref_out = run_driver(tmp_path, need("0.4.0"), model, ps, tp=1, own=True, name="own040", chunk=8192)
    assert ref_run.returncode == 0, ref_run.stderr[-4000:]
    for i, (x, y) in enumerate(zip(got, samples(ref_out, ps), strict=True)):
        for k in range(len(LAYERS)):
            assert torch.equal(x["layers"][k], y["layers"][k]), f"sample {i} layer {LAYERS[k]} differs"


def test_speculators_030_without_the_unique_reply_shim_is_wrong(tmp_path, tiny_model):
    """Fails once vLLM's collective_rpc gives speculators 0.3.0 what it indexes into again."""
    spec = need("0.3.0")
    model = tiny_model("llama", dtype="float32")
    ps = prompts(30, lengths=(37, 5, 64, 12))
    r, out = run_driver(
        tmp_path, spec, model, ps, tp=1, own=False, name="noshim", env={"HSCAPTURE_DISABLE_SHIMS": "unique_reply_list"}
    )
    if r.returncode != 0:
        return  # the driver crashed on the wrong shape: still needed
    got = samples(out, ps)
    assert any(len(s["layers"]) != 4 or s["layers"][0].shape != (len(ps[0]), 128) for s in got), (
        "0.3.0 produced correct data without the shim: remove unique_reply_list or re-key it"
    )
