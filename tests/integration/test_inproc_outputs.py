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
    model, stage, spec, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
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
    llm = LLM(**kw)
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, detokenize=False,
                        extra_args={"kv_transfer_params": {"include_output_tokens": True}})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    answers = [{"prompt": list(o.prompt_token_ids), "generated": list(o.outputs[0].token_ids),
                "params": o.kv_transfer_params} for o in outs]
    # The client's wait: each file's lock, given up once the file is whole (20 s each at most, then reported).
    missing = []
    for a in answers:
        path = a["params"]["hidden_states_path"]
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
    print("ANSWERS " + json.dumps({"answers": answers, "missing": missing, "drafts": drafts}), flush=True)
"""


@pytest.mark.parametrize("spec", ["none", "ngram"])
def test_an_engine_in_the_callers_process_writes_every_file_of_prompt_and_response(tmp_path, tiny_model, spec):
    model = tiny_model("llama", "float32")
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
        [sys.executable, str(script), model, str(stage), spec, json.dumps(prompts)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if spec == "ngram" and "spec decode is not supported" in r.stderr:
        pytest.skip("this vLLM's CPU backend has no speculative decoding")
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("ANSWERS ")]
    assert r.returncode == 0 and line, r.stdout[-2000:] + r.stderr[-4000:]
    out = json.loads(line[-1].removeprefix("ANSWERS "))
    assert out["missing"] == [], f"files never written after generate returned: {out['missing']}"
    if spec == "ngram":  # drafts proposed and some rejected: rows computed, then replaced at their positions
        drafted, accepted = (
            out["drafts"]["vllm:spec_decode_num_draft_tokens"],
            out["drafts"]["vllm:spec_decode_num_accepted_tokens"],
        )
        assert 0 < accepted < drafted, out["drafts"]
    answers = [(a["prompt"], a["generated"], Path(a["params"]["hidden_states_path"])) for a in out["answers"]]
    files_equal_hf(model, tmp_path, answers, outputs=[True] * len(answers))
