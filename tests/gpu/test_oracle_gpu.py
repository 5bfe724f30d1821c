"""The whole path on a GPU with real vLLM: capture through the CUDA device path equals HF transformers
token by token (float32), chunked prefill forced, several prompts; and the device path was the one used.
vLLM's defaults (torch.compile, CUDA graphs replaying the capture) on its default runner, eager on the same runner,
and the V1 runner under the defaults where this vLLM still has it.

Tolerance 5e-3 (CPU oracle tests: 1e-3): vLLM's Triton attention computes float32 dot products in TF32
on the GPU. A shifted layer must still be far outside it."""

from __future__ import annotations

import os
import random

import pytest
from engines import ENGINES

pytest.importorskip("vllm")
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
def test_gpu_capture_matches_transformers(tmp_path, tiny_model, engine):
    """Under the defaults the hooks are traced into the compiled graph and their device launches recorded into
    vLLM's CUDA graphs; every step's rows come from the replayed launches (stamped per step, checked)."""
    compiled = engine
    from hscapture import load_sample
    from hscapture.cli.extract import ExtractOptions, run_extract
    from hscapture.testing import reference
    from hscapture.testing.compare import compare

    model = tiny_model("llama")
    rng = random.Random(3)
    ps = [[rng.randrange(4, 1024) for _ in range(n)] for n in (5, 40, 77, 12, 64, 1, 130)]
    rep = run_extract(
        ExtractOptions(
            model=model,
            prompts=ps,
            out=str(tmp_path / "out"),
            convention="before",
            layers=[0, 2, 4],
            tp=1,
            dtype="float32",
            max_num_batched_tokens=48,
            progress=False,
            durable=False,
            compile=compiled,
            llm_kwargs={"gpu_memory_utilization": 0.3, "max_num_seqs": 8},
        )
    )
    import json

    man = json.loads((tmp_path / "out" / "manifest.json").read_text())
    got = sorted((r["index"], r["length"]) for r in man["samples"])
    assert rep.samples == len(ps) and rep.device_path == "device", f"{rep}; records (index, length) {got}"
    ours = [
        load_sample(tmp_path / "out" / "hidden_states" / f"hs_{i}.safetensors")["hidden_states"] for i in range(len(ps))
    ]
    cmp = compare(ours, reference.compute(model, ps, rep.layer_ids, "before"))
    print(
        f"GPU_ORACLE {os.environ.get('VLLM_USE_V2_MODEL_RUNNER', 'default')} runner, "
        f"{'defaults' if compiled else 'eager'}: worst relative error {cmp.worst:.2e} at {cmp.where}"
    )
    assert cmp.ok(5e-3), f"worst relative error {cmp.worst:.2e} at {cmp.where}"
    shifted = compare(
        ours, reference.compute(model, ps, [i + 1 for i in rep.layer_ids[:-1]] + [rep.layer_ids[-1]], "before")
    )
    assert shifted.worst > 0.05, f"a shifted layer passed ({shifted.worst:.2e})"
