"""Pipeline parallelism on real GPUs (needs 2): PP=2, layers of both stages captured, sent to the last stage's
writer and written once; equal to HF transformers token by token (float32, TF32 tolerance as the GPU oracle)."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 GPUs", allow_module_level=True)


def test_pp2_captures_both_stages(tmp_path, tiny_model, monkeypatch):
    from hscapture import load_sample
    from hscapture.cli.extract import ExtractOptions, run_extract
    from hscapture.testing import reference
    from hscapture.testing.compare import compare

    model = tiny_model("llama")
    rng = random.Random(5)
    ps = [[rng.randrange(4, 1024) for _ in range(n)] for n in (9, 70, 33, 130, 5)]
    rep = run_extract(
        ExtractOptions(
            model=model,
            prompts=ps,
            out=str(tmp_path / "pp2"),
            convention="after",
            layers=[0, 1, 3],
            tp=1,
            pp=2,
            dtype="float32",
            max_num_batched_tokens=64,
            progress=False,
            durable=False,
            llm_kwargs={"gpu_memory_utilization": 0.3, "max_num_seqs": 8},
        )
    )
    assert rep.samples == len(ps)
    files = sorted(p.name for p in (tmp_path / "pp2" / "hidden_states").iterdir())
    assert files == sorted(f"hs_{i}.safetensors" for i in range(len(ps))), files
    ours = [
        load_sample(tmp_path / "pp2" / "hidden_states" / f"hs_{i}.safetensors")["hidden_states"] for i in range(len(ps))
    ]
    cmp = compare(ours, reference.compute(model, ps, rep.layer_ids, "after"))
    print(f"PP2_ORACLE worst relative error {cmp.worst:.2e} at {cmp.where} (path {rep.device_path})")
    assert cmp.ok(5e-3), f"worst relative error {cmp.worst:.2e} at {cmp.where}"
