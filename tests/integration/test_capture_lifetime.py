"""A closed capture is freed while its engine lives on, through real vLLM on CPU. vLLM freezes the engine's start-up
heap (``gc.freeze``) out of the collector's reach, so a capture built then and closed later (a reload, or speculators'
driver setting capture up again) is freed by reference counts alone: no cycle through it, and nothing the model runner
keeps (hscapture's wrapper on its step preparation) may still reach it. Each new capture wraps the runner once, and
captures as the first did."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hscapture import runtime_env

pytestmark = [pytest.mark.integration, pytest.mark.newest]

SCRIPT = r"""
import gc, json, sys, weakref
from vllm import LLM, SamplingParams


def worker_of(w):
    return getattr(w, "worker", w)  # vLLM's WorkerWrapperBase keeps what is set on it: the worker itself


def wrappers(w):
    # How many of hscapture's wrappers the runner's step preparation sits under (its `prepared` closures, nested).
    runner = worker_of(w).model_runner
    fn = vars(runner).get("prepare_inputs") or vars(runner).get("_prepare_inputs")
    n = 0
    while fn is not None and getattr(fn, "__name__", "") == "prepared":
        n += 1
        fn = next((c.cell_contents for c in fn.__closure__ or () if callable(c.cell_contents)
                   and getattr(c.cell_contents, "__name__", "") in ("prepared", "prepare_inputs", "_prepare_inputs")),
                  None)
    return n


def set_up_again(w, layers):
    # speculators' driver setting capture up again: the capture built at start-up is closed and replaced.
    worker = worker_of(w)
    old, session = weakref.ref(worker._hscapture), worker._hscapture.session  # the session takes no weak reference
    worker._setup_hidden_states_capture(layers)
    gc.collect()
    # Its pinned buffers and device arena go with the session: held by nothing but `session` here (and the call's own).
    return {"old_freed": old() is None, "session_held": sys.getrefcount(session) - 2,
            "new": worker._hscapture is not None}


def sample_rows(w):
    return [list(t.shape) for t in worker_of(w)._get_captured_states()]


if __name__ == "__main__":
    model, out, layers = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=128, max_num_batched_tokens=64, seed=0,
              skip_tokenizer_init=True, enable_prefix_caching=False, gpu_memory_utilization=0.3,
              worker_cls="hscapture.worker.CaptureWorker",
              additional_config={"hscapture": {"layers": layers, "convention": "after", "out": out}})
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], sp, use_tqdm=False)
    report = {"wrappers_at_start": llm.collective_rpc(wrappers)[0]}
    for k in range(2):
        report[f"again_{k}"] = llm.collective_rpc(set_up_again, args=(layers,))[0]
        report[f"wrappers_{k}"] = llm.collective_rpc(wrappers)[0]
    llm.collective_rpc("_reset_capture")
    llm.generate([{"prompt_token_ids": [3, 4, 5, 6, 7, 8, 9]}], sp, use_tqdm=False)
    report["shapes"] = llm.collective_rpc(sample_rows)[0]
    report["hidden"] = json.load(open(model + "/config.json"))["hidden_size"]
    print("REPORT " + json.dumps(report), flush=True)
"""


def test_a_capture_closed_in_a_running_engine_is_freed_and_the_next_one_captures(tmp_path, tiny_model):
    model = tiny_model("llama", "float32")
    script = tmp_path / "lifetime.py"
    script.write_text(SCRIPT)
    env = {**os.environ, **runtime_env.cpu_defaults(1), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    layers = [0, 2]
    r = subprocess.run(
        [sys.executable, str(script), model, str(tmp_path / "out"), json.dumps(layers)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("REPORT ")]
    assert r.returncode == 0 and line, r.stdout[-2000:] + r.stderr[-4000:]
    rep = json.loads(line[-1].removeprefix("REPORT "))
    for k in range(2):
        assert rep[f"again_{k}"] == {"old_freed": True, "session_held": 0, "new": True}, rep
        assert rep[f"wrappers_{k}"] == rep["wrappers_at_start"], f"wrappers stacked on the runner: {rep}"
    assert rep["wrappers_at_start"] == 1, f"V1 and V2 runners alike prepare each step through one method: {rep}"
    # The last capture took the prompt's 7 tokens at each layer: it captures as the one built at start-up did.
    assert rep["shapes"] == [[7, rep["hidden"]]] * len(layers), rep
