"""Prompt and response under speculative decoding on the GPU, vLLM's defaults (compiled, CUDA graphs, its default
model runner, the engine in a process of its own): a draft model (the target with noise: some drafts accepted, most
rejected), 3 draft tokens a step, 8 requests in one ``generate``.

- Synchronous scheduling (``async_scheduling=False``): each rejected draft's row is replaced by the next step's row at
  that position, so every file holds exactly the prompt and generated tokens but the last, equal to HF transformers.
- Asynchronous scheduling (``async_scheduling=True``, where vLLM schedules a step before the previous step's drafts
  are verified and its positions assume every draft accepted): each request asking for its generated tokens is
  refused at admission, its answer naming ``--no-async-scheduling``; the prompt-only requests beside it get files
  equal to HF.
- Neither capture changes a generated token: each run equals the engine without hscapture under the same scheduling
  (``off-sync``, ``off-async``). Synchronous and asynchronous scheduling are not compared with each other: they batch
  different tokens into each step, and a float32 argmax may break a near tie the other way."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest
from client_script import HELPERS

pytest.importorskip("vllm")
pytestmark = pytest.mark.gpu

LAYERS = [1, 2, 4]

_DRIVER = r"""
import json, os, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    model, draft, stage, keep, mode, prompts_file = sys.argv[1:7]  # mode: [off-]sync or [off-]async
    prompts = json.load(open(prompts_file))
    kw = dict(model=model, dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.3, max_model_len=512,
              enable_prefix_caching=False, seed=0, disable_log_stats=False,
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3})
    kw["async_scheduling"] = mode.endswith("async")
    if not mode.startswith("off"):
        kw |= capture_kwargs(stage, "file")
    llm = LLM(**kw)
    outputs = [mode == "sync" or (mode == "async" and k % 2 == 0) for k in range(len(prompts))]
    sps = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, detokenize=False,
                          extra_args={"kv_transfer_params": {"include_output_tokens": True}} if o else None)
           for o in outputs]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    answers = []
    for k, (o, w) in enumerate(zip(outs, outputs)):
        params = o.kv_transfer_params or {}
        if params.get("hidden_states_path"):
            take(params["hidden_states_path"], os.path.join(keep, f"{k}.safetensors"))
        answers.append({"generated": list(o.outputs[0].token_ids), "params": params, "outputs": w})
    drafts = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if "spec_decode" in m.name}
    asynchronous = bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)
    print("ANSWERS " + json.dumps({"answers": answers, "drafts": drafts, "async": asynchronous}), flush=True)
"""


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(4, 1000) for _ in range(rng.randint(5, 200))] for _ in range(8)]


def _run(tmp_path, model: str, draft: str, mode: str) -> dict:
    stage, keep = tmp_path / f"stage-{mode}", tmp_path / f"keep-{mode}"
    stage.mkdir()
    keep.mkdir()
    script = tmp_path / "spec.py"
    script.write_text(f"LAYERS = {LAYERS}\n" + HELPERS + _DRIVER)
    env = {**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "HSCAPTURE_DEVICE_PATH": "required"}
    cmd = [sys.executable, str(script), model, draft, str(stage), str(keep), mode, str(tmp_path / "prompts.json")]
    start = time.monotonic()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        print(f"SPEC_RUN {mode}: {time.monotonic() - start:.0f} s", flush=True)
    except subprocess.TimeoutExpired as e:
        tail = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{mode} did not finish in 300 s:\n" + "\n".join(tail.splitlines()[-40:]))
    line = [x for x in r.stdout.splitlines() if x.startswith("ANSWERS ")]
    if r.returncode != 0 or not line:
        pytest.fail(f"{mode} failed:\n" + "\n".join((r.stdout + r.stderr).splitlines()[-40:]))
    out = json.loads(line[-1].removeprefix("ANSWERS "))
    out["keep"] = keep
    return out


def _first_differences(runs: list[list[int]], baseline: list[list[int]]) -> list[tuple[int, int]]:
    """(request, first generated position that differs) for each request whose tokens differ from the baseline's."""
    found = []
    for k, (got, want) in enumerate(zip(runs, baseline, strict=True)):
        if got != want:
            firsts = (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
            found.append((k, next(firsts, min(len(got), len(want)))))
    return found


def test_speculative_decoding_captures_exactly_when_synchronous_and_refuses_generated_tokens_when_not(
    tmp_path, tiny_model
):
    from safetensors.torch import load_file

    from hscapture.testing import reference, tiny
    from hscapture.testing.compare import compare

    model = tiny_model("llama", "float32")
    draft = str(tiny.draft(model, tmp_path / "draft", noise=0.1))
    prompts = _prompts()
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    runs = {mode: _run(tmp_path, model, draft, mode) for mode in ("off-sync", "sync", "off-async", "async")}
    flags = {m: r["async"] for m, r in runs.items()}
    assert flags == {"off-sync": False, "sync": False, "off-async": True, "async": True}, flags
    drafted = runs["sync"]["drafts"]["vllm:spec_decode_num_draft_tokens"]
    accepted = runs["sync"]["drafts"]["vllm:spec_decode_num_accepted_tokens"]
    print(f"SPEC_DRAFTS sync: {accepted} of {drafted} draft tokens accepted; async: {runs['async']['drafts']}")
    assert 0 < accepted < drafted, runs["sync"]["drafts"]
    tokens = {m: [a["generated"] for a in r["answers"]] for m, r in runs.items()}
    # What each check found, printed before any of them fails: a run cut by the call's limit loses pytest's summary.
    differ = {m: _first_differences(tokens[m], tokens[f"off-{m}"]) for m in ("sync", "async")}
    apart = _first_differences(tokens["async"], tokens["sync"])  # not asserted: scheduling, not capture
    refused = [a["params"] for a in runs["async"]["answers"] if a["outputs"]]
    seqs, got, wrong_ids = [], [], []
    for mode in ("sync", "async"):
        for k, a in enumerate(runs[mode]["answers"]):
            if mode == "async" and a["outputs"]:
                continue
            want = prompts[k] + a["generated"][:-1] if a["outputs"] else prompts[k]
            f = load_file(runs[mode]["keep"] / f"{k}.safetensors")
            if f["token_ids"].tolist() != want:
                wrong_ids.append((mode, k, len(want), len(f["token_ids"])))
                continue
            seqs.append(want)
            got.append(f["hidden_states"])
    cmp = compare(got, reference.compute(model, seqs, LAYERS, "before"))
    # Rows the draft model computed instead (a compiled graph of the target's, with its taps, replayed for the draft
    # would write them) are told apart from noise by comparing with the draft's own states.
    of_draft = compare(got, reference.compute(draft, seqs, LAYERS, "before"))
    print(
        f"SPEC_DIAG requests whose tokens differ from the run without capture, (request, first position): {differ}; "
        f"between the two schedulings (not a capture's doing): {apart}; refused answers: "
        f"{refused}; files with other token ids (mode, request, expected, found): {wrong_ids}; vs transformers: "
        f"worst {cmp.worst:.2e} at {cmp.where}; vs the draft model's states: worst {of_draft.worst:.2e}",
        flush=True,
    )
    assert differ["sync"] == [] and differ["async"] == [], "the capture changed generated tokens"
    for params in refused:
        assert "hidden_states_path" not in params, params
        assert "--no-async-scheduling" in params.get("hidden_states_error", ""), params
    assert wrong_ids == [] and len(got) == 8 + 4, wrong_ids
    print(f"SPEC_ORACLE prompt + response under drafts vs transformers: worst relative error {cmp.worst:.2e}")
    assert cmp.ok(5e-3), f"worst relative error {cmp.worst:.2e} at {cmp.where}"
