"""Preemption under vLLM's defaults (torch.compile and CUDA graphs) and on the V1 runner where this vLLM has it: a KV
cache too small for the requests running together (48 blocks of 32 tokens for 16 requests of up to 300 prompt + 40
generated tokens), so vLLM preempts requests and recomputes them from their first token when they resume, prompt
and generated tokens alike, in chunked-prefill steps beside other requests' decode steps (some replayed from FULL
graphs). Every request captures its prompt, every other one its response too (``include_output_tokens``).

Checked: vLLM preempted (its own counter); the capture changes no generated token (the same run without capture);
every file holds exactly its request's tokens once, each row equal to HF transformers' state of that token (the
recomputed steps' rows replace what the preempted request had captured, never add to it)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from client_script import HELPERS
from engines import ENGINES

pytest.importorskip("vllm")
pytestmark = pytest.mark.gpu

LAYERS = [1, 2, 4]  # before convention: inputs of layers 1 and 2, and the final output (N = 4)

# The driver (after client_script.HELPERS), in a process of its own per run:
# `python driver.py MODEL STAGE KEEP off|file PROMPTS BLOCKS` (it runs on vLLM's CPU build too).
DRIVER = r"""
import json, os, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    model, stage, keep, fmt, prompts_file, blocks = sys.argv[1:7]
    capture = fmt != "off"
    prompts = json.load(open(prompts_file))
    kw = dict(model=model, dtype="float32", skip_tokenizer_init=True, max_model_len=384, max_num_batched_tokens=96,
              enable_prefix_caching=False, seed=0, block_size=32,
              num_gpu_blocks_override=int(blocks), disable_log_stats=False, gpu_memory_utilization=0.3)
    if capture:
        kw |= capture_kwargs(stage, fmt)
    llm = LLM(**kw)
    params = []
    for k in range(len(prompts)):
        extra = {"kv_transfer_params": {"include_output_tokens": True}} if capture and k % 2 == 0 else None
        params.append(SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, detokenize=False,
                                     extra_args=extra))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    preempted = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    tokens = []
    for k, o in enumerate(outs):
        tokens.append(list(o.outputs[0].token_ids))
        path = (o.kv_transfer_params or {}).get("hidden_states_path") if capture else None
        if not capture:
            continue
        assert path, f"request {k}: no hidden_states_path in {o.kv_transfer_params}"
        take(path, os.path.join(keep, f"{k}.safetensors"))
    print("RESULT " + json.dumps({"tokens": tokens, "preempted": preempted}), flush=True)
"""


def prompts() -> list[list[int]]:
    rng = random.Random(31)
    return [[rng.randrange(4, 1000) for _ in range(rng.randint(20, 300))] for _ in range(16)]


def drive(tmp, model: str, fmt: str, blocks: int) -> dict:
    """One run of DRIVER; its tokens, its preemption count, and (capturing) the files in ``tmp/keep-<fmt>``."""
    script, listing = tmp / "driver.py", tmp / "prompts.json"
    script.write_text(f"LAYERS = {LAYERS}\n" + HELPERS + DRIVER)
    listing.write_text(json.dumps(prompts()))
    stage, keep = tmp / f"stage-{fmt}", tmp / f"keep-{fmt}"
    stage.mkdir()
    keep.mkdir()
    env = {**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    cmd = [sys.executable, str(script), model, str(stage), str(keep), fmt, str(listing), str(blocks)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=420)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"{fmt} did not finish in 420 s:\n" + "\n".join((out + err).splitlines()[-60:]))
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode != 0 or not line:
        pytest.fail(f"{fmt} failed:\n" + "\n".join((r.stdout + r.stderr).splitlines()[-40:]))
    return json.loads(line[-1][len("RESULT ") :])


@pytest.mark.parametrize("engine", [p for p in ENGINES if p.id != "eager"], indirect=True)
def test_preempted_requests_keep_exactly_their_tokens_rows(tmp_path, tiny_model, engine):
    from safetensors.torch import load_file

    from hscapture.testing import reference
    from hscapture.testing.compare import compare

    assert engine, "vLLM's defaults: compiled, CUDA graphs"
    model = tiny_model("llama", "float32")
    off = drive(tmp_path, model, "off", blocks=48)
    on = drive(tmp_path, model, "file", blocks=48)
    print(f"PREEMPTION preempted {on['preempted']} times (without capture {off['preempted']})")
    assert on["preempted"] > 0, "the test's premise: vLLM preempted requests (48 blocks of 32 tokens)"
    assert [len(t) for t in on["tokens"]] == [40] * len(prompts())
    assert on["tokens"] == off["tokens"], "the capture changed generated tokens"
    seqs = [p + (on["tokens"][k][:-1] if k % 2 == 0 else []) for k, p in enumerate(prompts())]
    files = [load_file(tmp_path / "keep-file" / f"{k}.safetensors") for k in range(len(seqs))]
    for k, (f, s) in enumerate(zip(files, seqs, strict=True)):
        assert f["token_ids"].tolist() == s, f"request {k}: token ids"
        assert tuple(f["hidden_states"].shape) == (len(s), len(LAYERS), f["hidden_states"].shape[-1]), f"request {k}"
    cmp = compare([f["hidden_states"] for f in files], reference.compute(model, seqs, LAYERS, "before"))
    print(f"PREEMPTION_ORACLE vs transformers: worst relative error {cmp.worst:.2e} at {cmp.where}")
    assert cmp.ok(5e-3), f"worst relative error {cmp.worst:.2e} at {cmp.where}"
