"""The second oracle: vLLM's own extraction (`extract_hidden_states` + `ExampleHiddenStatesConnector`) and
hscapture's `before`-convention capture, same model, same prompts, same GPU: equal token by token.

Both run with vLLM's defaults (torch.compile, CUDA graphs, each on the model runner vLLM picks for it) and without
chunked prefill (vLLM's own path supports it only from 0.24). Tolerance 5e-3 as for the GPU
oracle (float32 through TF32 kernels; the two runs batch differently); the worst error is printed."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.gpu

LAYERS = [1, 2, 4]  # before convention: inputs of layers 1 and 2, and the final output (N = 4)

_OWN = r"""
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    model, out, prompts = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3]))
    llm = LLM(model=model, dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.3,
              max_model_len=256, max_num_seqs=8, enable_chunked_prefill=False, enable_prefix_caching=False, seed=0,
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}}},
              kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                  "kv_connector_extra_config": {"shared_storage_path": out}})
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, detokenize=False),
                       use_tqdm=False)
    # Where the connector wrote each request (its file names carry the engine's internal request id).
    print("OWN_PATHS " + json.dumps([(r.kv_transfer_params or {}).get("hidden_states_path") for r in res]), flush=True)
"""


def test_hscapture_equals_vllms_own_extraction(tmp_path, tiny_model):
    from safetensors.torch import load_file

    from hscapture import load_sample
    from hscapture.cli.extract import ExtractOptions, run_extract
    from hscapture.testing.compare import compare

    model = tiny_model("llama")
    rng = random.Random(11)
    ps = [[rng.randrange(4, 1024) for _ in range(n)] for n in (5, 40, 77, 12, 64, 130)]
    (tmp_path / "prompts.json").write_text(json.dumps(ps))
    script = tmp_path / "own.py"
    script.write_text(f"LAYERS = {LAYERS}\n" + _OWN)
    r = subprocess.run(
        [sys.executable, str(script), model, str(tmp_path / "own"), str(tmp_path / "prompts.json")],
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"},
    )
    line = [x for x in r.stdout.splitlines() if x.startswith("OWN_PATHS ")]
    if r.returncode != 0 or not line:
        pytest.fail("vLLM's own extraction failed:\n" + "\n".join((r.stdout + r.stderr).splitlines()[-25:]))
    own_paths = json.loads(line[0][len("OWN_PATHS ") :])
    assert all(own_paths), f"vLLM's own extraction reported no file for some requests: {own_paths}"
    rep = run_extract(
        ExtractOptions(
            model=model,
            prompts=ps,
            out=str(tmp_path / "ours"),
            convention="before",
            layers=LAYERS,
            tp=1,
            dtype="float32",
            max_num_batched_tokens=256,
            progress=False,
            durable=False,
            compile=True,
            llm_kwargs={"gpu_memory_utilization": 0.3, "max_num_seqs": 8},
        )
    )
    assert rep.layer_ids == LAYERS
    ours, theirs = [], []
    for i, path in enumerate(own_paths):
        t = load_file(path)
        s = load_sample(tmp_path / "ours" / "hidden_states" / f"hs_{i}.safetensors")
        assert t["token_ids"].tolist() == ps[i] == s["token_ids"].tolist()
        assert tuple(t["hidden_states"].shape) == tuple(s["hidden_states"].shape)
        ours.append(s["hidden_states"])
        theirs.append(t["hidden_states"])
    cmp = compare(ours, theirs)
    exact = all(bool((a == b).all()) for a, b in zip(ours, theirs, strict=True))
    print(
        f"SECOND_ORACLE vLLM's own extraction vs hscapture: worst relative error {cmp.worst:.2e}, bit-identical {exact}"
    )
    assert cmp.ok(5e-3), f"worst relative error {cmp.worst:.2e} at {cmp.where}"
