"""Prompt and response through hscapture's connector with the engine in the caller's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), as a script using ``LLM`` runs it: such an engine steps only inside
``generate``, so the step that would carry a call's last finished requests to the workers never comes. Every file must
appear after ``generate`` returns (the client waits for its lock, as speculators does), each holding exactly its prompt
and generated tokens but the last, equal to HF transformers' states; with speculative decoding (ngram drafts, some
rejected) too, where a rejected draft's row is computed and then replaced at that position by the next step's."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from connector_support import LAYERS
from test_output_tokens import files_equal_hf

from hscapture import runtime_env

pytestmark = [pytest.mark.integration, pytest.mark.newest]

SCRIPT = r"""
import fcntl, json, sys, time
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig

if __name__ == "__main__":
    model, stage, spec, prompts, draft = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5]
    kw = dict(model=model, dtype="float32", enforce_eager=True, max_model_len=256, max_num_batched_tokens=64, seed=0,
              skip_tokenizer_init=True, enable_prefix_caching=False, disable_log_stats=False,
              gpu_memory_utilization=0.3, worker_cls="hscapture.worker.CaptureWorker",
              additional_config={"hscapture": {"layers": LAYERS, "convention": "before"}},
              kv_transfer_config=KVTransferConfig(kv_connector="HscaptureConnector",
                  kv_connector_module_path="hscapture.connector", kv_role="kv_producer",
                  kv_connector_extra_config={"shared_storage_path": stage, "format": "file"}))
    if spec == "ngram":
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                    "prompt_lookup_min": 1}
    elif spec.startswith("draft"):  # a draft model; "draft-async" with vLLM's asynchronous scheduling
        kw["speculative_config"] = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
        kw["async_scheduling"] = spec == "draft-async"
    llm = LLM(**kw)
    outputs = [spec != "draft-async" or k % 2 == 0 for k in range(len(prompts))]  # async: every other prompt-only
    sps = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, detokenize=False,
                          extra_args={"kv_transfer_params": {"include_output_tokens": True}} if o else None)
           for o in outputs]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    answers = [{"prompt": list(o.prompt_token_ids), "generated": list(o.outputs[0].token_ids),
                "params": o.kv_transfer_params or {}, "outputs": w} for o, w in zip(outs, outputs)]
    # The client's wait: each file's lock, given up once the file is whole (20 s each at most, then reported).
    missing = []
    for a in answers:
        path = a["params"].get("hidden_states_path")
        if path is None:  # refused at admission: its answer says why (checked by the test)
            continue
        deadline = time.monotonic() + 20
        with open(path + ".lock", "rb") as lock:
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        missing.append(path)
                        break
                    time.sleep(0.05)
    drafts = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if "spec_decode" in m.name}
    asynchronous = bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)
    print("ANSWERS " + json.dumps({"answers": answers, "missing": missing, "drafts": drafts,
                                   "async": asynchronous}), flush=True)
"""


@pytest.mark.parametrize("spec", ["none", "ngram", "draft", "draft-async"])
def test_an_engine_in_the_callers_process_writes_every_file_of_prompt_and_response(tmp_path, tiny_model, spec):
    """``draft``: a draft model (the target with noise, some drafts rejected), synchronous scheduling: exact, as
    ``ngram``. ``draft-async``: vLLM's asynchronous scheduling, where the scheduler's positions assume every draft
    accepted: each request asking for its generated tokens is refused at admission (its answer says why and what to
    set), and the prompt-only requests beside it get their files, equal to HF."""
    from hscapture.testing import tiny

    model = tiny_model("llama", "float32")
    draft = tiny.draft(model, tmp_path.parent / "draft", noise=0.1) if spec.startswith("draft") else Path(model)
    rng = random.Random(3)
    prompts = [
        (lambda base: (base * 5)[: rng.randint(12, 30)])([rng.randrange(4, 60) for _ in range(6)]) for _ in range(6)
    ]
    stage = tmp_path / "stage"
    stage.mkdir()
    script = tmp_path / "inproc.py"
    script.write_text(f"LAYERS = {LAYERS}\n" + SCRIPT)
    env = {**os.environ, **runtime_env.cpu_defaults(1), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    r = subprocess.run(
        [sys.executable, str(script), model, str(stage), spec, json.dumps(prompts), str(draft)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if spec != "none" and "spec decode is not supported" in r.stderr:
        pytest.skip("this vLLM's CPU backend has no speculative decoding")
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("ANSWERS ")]
    assert r.returncode == 0 and line, r.stdout[-2000:] + r.stderr[-4000:]
    out = json.loads(line[-1].removeprefix("ANSWERS "))
    if spec == "draft-async" and not out["async"]:  # vLLM 0.32's CPU platform turns it off (the GPU test shows it)
        pytest.skip("this vLLM runs speculative decoding synchronously on the CPU")
    assert out["async"] is False or spec == "draft-async", "vLLM scheduled asynchronously"
    assert out["missing"] == [], f"files never written after generate returned: {out['missing']}"
    if spec != "none":  # drafts proposed and some rejected: rows computed, then replaced at their positions
        drafted, accepted = (
            out["drafts"]["vllm:spec_decode_num_draft_tokens"],
            out["drafts"]["vllm:spec_decode_num_accepted_tokens"],
        )
        assert 0 < accepted < drafted, out["drafts"]
    for a in out["answers"]:
        if spec == "draft-async" and a["outputs"]:
            assert "hidden_states_path" not in a["params"], a["params"]
            assert "--no-async-scheduling" in a["params"]["hidden_states_error"], a["params"]
            assert len(a["generated"]) == 30, "the refused request itself runs as usual"
    kept = [a for a in out["answers"] if "hidden_states_path" in a["params"]]
    assert len(kept) == (3 if spec == "draft-async" else 6)
    answers = [(a["prompt"], a["generated"], Path(a["params"]["hidden_states_path"])) for a in kept]
    files_equal_hf(model, tmp_path, answers, outputs=[a["outputs"] for a in kept])
