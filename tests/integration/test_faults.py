"""The oracle comparison fails when attribution or layer ids are wrong (so its passing means something)."""

from __future__ import annotations

import json

import pytest
import torch
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


def test_a_step_the_ranks_disagree_on_leaves_nothing_and_resume_heals_it(tmp_path, tiny_model):
    """Rank 1's rows of sample 3 differ (one request per step; sample 3's one step also completes it). The run
    fails naming the ranks, and nothing of that step or later is on disk: no file, no journal line, no record —
    although the writing rank's own rows of sample 3 were whole, they were never agreed on. A resumed run captures
    the rest, and the dataset equals an uninterrupted run's bit for bit (the same steps at TP=2)."""
    from hscapture import RankMismatchError, load_sample

    model, ps = tiny_model("llama"), prompts(5, lengths=(6, 40, 12, 20, 70, 5, 33, 9))
    kw = dict(tp=2, convention="after", layers=[1, 3])
    seq = {"max_num_seqs": 1}
    with pytest.raises(RankMismatchError, match=r"ranks \[1\] disagree with rank 0"):
        extract(tmp_path / "a", model, ps, llm_kwargs={**seq, "worker_cls": "faulty.Sample3DiffersOnRank1Worker"}, **kw)
    out = tmp_path / "a" / "out"
    files = sorted(p.name for p in (out / "hidden_states").iterdir())
    assert files == ["hs_0.safetensors", "hs_1.safetensors", "hs_2.safetensors"], files
    journal = (out / "records.jsonl").read_text().splitlines()[1:]  # after the identity line
    assert sorted(json.loads(line)["index"] for line in journal) == [0, 1, 2], journal
    assert not (out / "manifest.json").exists()
    kept = {f: (out / "hidden_states" / f).read_bytes() for f in files}

    rep, resumed = extract(tmp_path / "a", model, ps, llm_kwargs=seq, resume=True, **kw)
    assert rep.samples == len(ps) - len(kept), "the resumed run captures exactly the samples that were missing"
    assert all((out / "hidden_states" / f).read_bytes() == b for f, b in kept.items()), "kept files untouched"
    _, fresh = extract(tmp_path / "b", model, ps, llm_kwargs=seq, **kw)
    for i, (a, b) in enumerate(zip(resumed, fresh, strict=True)):
        assert a["token_ids"].tolist() == b["token_ids"].tolist() == ps[i]
        assert torch.equal(a["hidden_states"], b["hidden_states"]), f"sample {i} differs from an uninterrupted run"
    assert [load_sample(out / "hidden_states" / f"hs_{i}.safetensors")["token_ids"].tolist() for i in range(8)] == ps


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
