"""The oracle comparison fails when attribution or layer ids are wrong (so its passing means something)."""

from __future__ import annotations

import pytest
from helpers import TOL, extract, prompts, reference

from hscapture.testing.compare import compare

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("worker", ["RotatedOrderWorker", "ShiftedLayersWorker"])
def test_wrong_capture_is_caught(tmp_path, tiny_model, worker):
    model = tiny_model("llama")
    ps = prompts(seed=7, lengths=(20, 45, 9, 30))
    rep, samples = extract(
        tmp_path, model, ps, tp=1, convention="after", layers=[0, 2], llm_kwargs={"worker_cls": f"faulty.{worker}"}
    )
    cmp = compare([s["hidden_states"] for s in samples], reference(tmp_path, model, ps, rep.layer_ids, "after"))
    assert not cmp.ok(TOL), f"{worker}: a wrong capture passed the comparison (worst {cmp.worst:.2e})"
    assert cmp.worst > 0.05


@pytest.mark.newest
def test_tp_ranks_that_disagree_are_named(tmp_path, tiny_model):
    from hscapture import RankMismatchError

    with pytest.raises(RankMismatchError, match=r"ranks \[1\] disagree with rank 0"):
        extract(
            tmp_path,
            tiny_model("llama"),
            prompts(5, lengths=(6, 9)),
            tp=2,
            convention="after",
            layers=[1],
            llm_kwargs={"worker_cls": "faulty.PerturbedRankWorker"},
        )


def test_non_finite_values_fail_by_default_and_are_skipped_on_request(tmp_path, tiny_model):
    from hscapture import NonFiniteError, load_manifest
    from hscapture.cli.extract import ExtractOptions, run_extract

    ps = prompts(13, lengths=(12, 50, 7))  # sample 1 spans two 32-token steps: poisoned in both
    opts = dict(
        model=tiny_model("llama"),
        prompts=ps,
        convention="after",
        layers=[1, 3],
        dtype="float32",
        max_num_batched_tokens=32,
        progress=False,
        durable=False,
        llm_kwargs={"worker_cls": "faulty.NaNWorker"},
    )
    with pytest.raises(NonFiniteError, match=r"sample 1 .*layer id 1 .*NaN/Inf"):
        run_extract(ExtractOptions(out=str(tmp_path / "strict"), **opts))
    rep = run_extract(ExtractOptions(out=str(tmp_path / "skip"), on_nonfinite="skip", **opts))
    assert rep.samples == 2
    m = load_manifest(tmp_path / "skip")
    assert [s["index"] for s in m["samples"]] == [0, 2]
    assert [s["index"] for s in m["skipped"]] == [1] and "NaN/Inf" in m["skipped"][0]["why"]
    assert not (tmp_path / "skip" / "hidden_states" / "hs_1.safetensors").exists()
