"""Tensor parallelism on real GPUs (needs 2): TP=2 output equals TP=1 output on the same weights and prompts,
the per-step checksums agree across the two ranks, and a divergence injected on rank 1 is reported naming it."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 GPUs", allow_module_level=True)

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"


def _extract(tmp_path, name, model, ps, tp, **kw):
    from hscapture import load_sample
    from hscapture.cli.extract import ExtractOptions, run_extract

    rep = run_extract(
        ExtractOptions(
            model=model,
            prompts=ps,
            out=str(tmp_path / name),
            convention="after",
            layers=[0, 2, 3],
            tp=tp,
            dtype="float32",
            max_num_batched_tokens=64,
            progress=False,
            durable=False,
            llm_kwargs={"gpu_memory_utilization": 0.3, "max_num_seqs": 8, **kw},
        )
    )
    return rep, [
        load_sample(tmp_path / name / "hidden_states" / f"hs_{i}.safetensors")["hidden_states"] for i in range(len(ps))
    ]


def _prompts():
    rng = random.Random(8)
    return [[rng.randrange(4, 1024) for _ in range(n)] for n in (9, 70, 33, 130, 5)]


@pytest.fixture
def device_env(monkeypatch):
    monkeypatch.setenv("HSCAPTURE_DEVICE_PATH", "required")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(INTEGRATION), os.environ.get("PYTHONPATH", "")]))
    sys.path.insert(0, str(INTEGRATION))


def test_tp2_equals_tp1(tmp_path, tiny_model, device_env):
    from hscapture.testing.compare import compare

    model = tiny_model("llama")
    ps = _prompts()
    r1, one = _extract(tmp_path, "tp1", model, ps, 1)
    r2, two = _extract(tmp_path, "tp2", model, ps, 2)
    assert r1.device_path == r2.device_path == "device"
    cmp = compare(two, one)
    print(f"TP2_VS_TP1 worst relative error {cmp.worst:.2e}")
    assert cmp.ok(5e-3), f"TP=2 differs from TP=1: {cmp.worst:.2e} at {cmp.where}"


def test_a_divergence_on_rank_1_is_named(tmp_path, tiny_model, device_env):
    from hscapture import RankMismatchError

    model, ps = tiny_model("llama"), _prompts()
    with pytest.raises(RankMismatchError, match=r"ranks \[1\] disagree with rank 0"):
        _extract(tmp_path, "bad", model, ps, 2, worker_cls="faulty.PerturbedRankWorker")
