"""The Rust CaptureSession driven from Python with real tensors and vLLM-shaped scheduler outputs."""

from __future__ import annotations

import json

import pytest
import torch

from hscapture import (
    AttributionError,
    CompatibilityError,
    ConfigError,
    NonFiniteError,
    OutputError,
    RankMismatchError,
    ShapeContractError,
    _native,
    load_manifest,
    load_sample,
)
from hscapture.adapters.vllm_compat import SAMPLE_KEY, step_of
from support import directory, new_req, sched

H = 8


def session(tmp_path=None, layers=(1, 3), assemble=True):
    return _native.CaptureSession(
        list(layers),
        "after",
        4,
        H,
        "float32",
        "float32",
        assemble=assemble,
        output=_native.Output(directory(tmp_path, durable=False) if tmp_path else None),
    )


def run(s, so, order, make):
    """One step: every slot sees `make(slot, rows)` as hidden states and ones as residual."""
    s.begin_step(step_of(so))
    s.plan(order)
    total = so.total_num_scheduled_tokens
    for slot in range(len(s.layer_ids)):
        h = make(slot, total)
        s.capture(slot, h, torch.ones_like(h))
    (out,) = s.end_step()  # a host step is accounted at its end: exactly one outcome
    s.release()  # no other rank to agree with: its samples may be stored
    return out


def rows_tagged(slot, rows):
    """Row r of slot s holds 100*s + r in every column."""
    return (torch.arange(rows, dtype=torch.float32)[:, None] + 100 * slot).expand(rows, H).contiguous()


def test_chunked_prefill_assembles_each_request_in_prompt_order(tmp_path):
    s = session()
    # step 1: runner order b, a; a (3 tokens) whole, b first 2 of 5
    _, _, rows, done = run(
        s,
        sched(new=[new_req("a", [1, 2, 3], 0), new_req("b", [4, 5, 6, 7, 8], 1)], n={"a": 3, "b": 2}),
        ["b", "a"],
        rows_tagged,
    )
    assert (rows, done) == (5, 1)
    # step 2: b continues at 2 with 3 tokens; a decodes one token
    _, _, rows, done = run(s, sched(cached=[("a", 3), ("b", 2)], n={"a": 1, "b": 3}), ["a", "b"], rows_tagged)
    assert (rows, done) == (3, 1)
    got = {d["sample"]: d for d in s.take_samples()}
    a = torch.frombuffer(bytearray(got[0]["data"]), dtype=torch.float32).reshape(got[0]["shape"])
    b = torch.frombuffer(bytearray(got[1]["data"]), dtype=torch.float32).reshape(got[1]["shape"])
    assert a.shape == (3, 2, H) and b.shape == (5, 2, H)
    assert got[1]["token_ids"] == [4, 5, 6, 7, 8]
    # a's tokens were step-1 rows 2..4; value = row + 100*slot + 1 (residual)
    assert a[:, 0, 0].tolist() == [3.0, 4.0, 5.0] and a[:, 1, 0].tolist() == [103.0, 104.0, 105.0]
    # b: step-1 rows 0..1, then step-2 rows 1..3 (row 0 was a's decode token)
    assert b[:, 0, 0].tolist() == [1.0, 2.0, 2.0, 3.0, 4.0]


def test_writer_files_and_manifest(tmp_path):
    s = session(tmp_path)
    run(s, sched(new=[new_req("a", [1, 2, 3], 7)], n={"a": 3}), ["a"], rows_tagged)
    recs = list(s.finish())
    assert [r["file"] for r in recs] == ["hidden_states/hs_7.safetensors"]
    sample = load_sample(tmp_path / recs[0]["file"])
    assert sample["hidden_states"].shape == (3, 2, H) and sample["token_ids"].tolist() == [1, 2, 3]
    assert sample["checksum"] == recs[0]["checksum"]
    manifest = {
        "format": _native.MANIFEST_FORMAT,
        "model": "m",
        "layer_ids": [1, 3],
        "convention": "after",
        "dtype": "float32",
        "hidden_size": H,
        "num_hidden_layers": 4,
        "samples": recs,
    }
    _native.write_manifest(str(tmp_path / "manifest.json"), json.dumps(manifest))
    assert load_manifest(tmp_path)["samples"][0]["length"] == 3
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(OutputError, match="corrupted"):
        load_manifest(tmp_path)


def test_contract_errors_are_typed():
    s = session()
    s.begin_step(step_of(sched(new=[new_req("a", [1, 2, 3], 0)], n={"a": 3})))
    s.plan(["a"])
    with pytest.raises(ShapeContractError, match=r"expected hidden size 8"):
        s.capture(0, torch.zeros(3, 4))
    with pytest.raises(ShapeContractError, match=r"expected dtype float32, found bfloat16"):
        s.capture(0, torch.zeros(3, H, dtype=torch.bfloat16))
    bad = torch.zeros(3, H)
    bad[1, 2] = float("nan")
    s.capture(0, bad)
    s.capture(1, torch.zeros(3, H))
    with pytest.raises(NonFiniteError, match=r"sample 0 .*layer id 1.*1 NaN/Inf"):
        s.end_step()
    assert not s.in_step


def test_attribution_errors_are_typed():
    s = session()
    with pytest.raises(AttributionError, match="prefix caching"):
        s.begin_step(step_of(sched(new=[new_req("a", [1, 2, 3, 4], 0, computed=2)], n={"a": 2})))
    s = session()
    s.begin_step(step_of(sched(new=[new_req("a", [1, 2], 0)], n={"a": 2})))
    with pytest.raises(AttributionError, match="did not schedule"):
        s.plan(["z"])


def test_rank_mismatch_names_ranks():
    with pytest.raises(RankMismatchError, match=r"step 3: .*ranks \[1\] disagree with rank 0"):
        _native.compare_steps("tensor-parallel", [(2, [7, 7]), (3, [5, -5])])
    with pytest.raises(RankMismatchError, match="no single step's checksum did"):
        _native.compare_steps("tensor-parallel", [(3, [5, 5])])


def test_non_writing_rank_checksums_match_the_writer():
    w, v = session(), session(assemble=False)
    so = sched(new=[new_req("a", [1, 2, 3], 0)], n={"a": 3})
    assert run(w, so, ["a"], rows_tagged)[1] == run(v, so, ["a"], rows_tagged)[1]
    assert v.take_samples() == []


def test_real_vllm_scheduler_output_shape():
    """step_of reads vLLM's own dataclasses (feature-detected fields)."""
    out = pytest.importorskip("vllm.v1.core.sched.output")
    import dataclasses

    def build(cls, **given):
        kw = {}
        for f in dataclasses.fields(cls):
            if f.name in given:
                kw[f.name] = given[f.name]
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                kw[f.name] = None
        return cls(**kw)

    from vllm import SamplingParams

    new = build(
        out.NewRequestData,
        req_id="r0",
        prompt_token_ids=[5, 6, 7],
        num_computed_tokens=0,
        sampling_params=SamplingParams(max_tokens=1, extra_args={SAMPLE_KEY: 4}),
    )
    cached = out.CachedRequestData.make_empty()
    so = build(
        out.SchedulerOutput,
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={"r0": 3},
        total_num_scheduled_tokens=3,
        finished_req_ids=set(),
    )
    step = step_of(so)
    assert step.new_requests == [_native.NewRequest("r0", [5, 6, 7], 0, sample=4, max_tokens=1)]
    assert (step.cached_requests, step.scheduled, step.total_tokens) == ([], [("r0", 3)], 3)
    assert (step.finished, step.preempted, step.with_outputs, step.outputs) == ([], [], [], [])


def test_step_of_passes_vllms_columns_and_pairs_them_in_the_core():
    """Cached requests cross as vLLM's columns (ids, computed tokens, resumed ids or the older flags); the core pairs
    them, keeps the scheduler's order of scheduled tokens, and refuses columns of different lengths or scheduled tokens
    that are not the scheduler's dict."""
    from types import SimpleNamespace

    so = sched(cached=[("b", 7), ("a", 5)], n={"b": 1, "a": 2}, resumed=["a"])
    step = step_of(so)
    assert step.cached_requests == [("b", 7, False), ("a", 5, True)]
    assert step.scheduled == [("b", 1), ("a", 2)]
    older = sched(cached=[("b", 7), ("a", 5)], n={"b": 1, "a": 2})
    older.scheduled_cached_reqs = SimpleNamespace(
        req_ids=["b", "a"], num_computed_tokens=[7, 5], resumed_from_preemption=[True, False]
    )
    assert step_of(older).cached_requests == [("b", 7, True), ("a", 5, False)]
    with pytest.raises(CompatibilityError, match="2 ids but 1 computed-token counts"):
        _native.Step(cached_ids=["b", "a"], cached_computed=[7])
    with pytest.raises(CompatibilityError, match="scheduled tokens"):
        _native.Step(scheduled={"a": -1})
    with pytest.raises(CompatibilityError, match="scheduled tokens are a list; expected a dict"):
        _native.Step(scheduled=[("a", 2)])


def test_worker_errors_cross_to_the_driver_typed(tmp_path):
    from hscapture.output import failures

    failures.raise_recorded(tmp_path, RuntimeError("engine died"))  # nothing recorded: returns
    failures.record_failure(str(tmp_path), 1, RankMismatchError("late"))
    failures.record_failure(str(tmp_path), 0, AttributionError("first"))
    failures.record_failure(str(tmp_path), 0, OutputError("a consequence"))  # the first error of a rank wins
    with pytest.raises(AttributionError, match=r"first \[raised by the worker of rank 0\]") as ei:
        failures.raise_recorded(tmp_path, RuntimeError("engine died"))
    assert isinstance(ei.value.__cause__, RuntimeError)
    with pytest.raises(AttributionError, match="first"):  # after a run the engine reported as finished
        failures.raise_recorded(tmp_path)
    failures.clear(tmp_path)
    failures.raise_recorded(tmp_path, RuntimeError("engine died"))


def test_compressed_output_reads_back_identical_and_verifies(tmp_path):
    from hscapture import load_sample

    so = sched(new=[new_req("a", list(range(1, 40)), 0)], n={"a": 39})
    for name, level in (("plain", None), ("packed", 3)):
        s = _native.CaptureSession(
            [1, 3],
            "after",
            4,
            H,
            "float32",
            "bfloat16",
            assemble=True,
            output=_native.Output(directory(tmp_path / name, durable=False, compress=level)),
        )
        run(s, so, ["a"], lambda slot, rows: torch.sin(rows_tagged(slot, rows) * 0.1))
        s.finish()
    a = load_sample(tmp_path / "plain" / "hidden_states" / "hs_0.safetensors")
    b = load_sample(tmp_path / "packed" / "hidden_states" / "hs_0.safetensors")
    same = [_native.checksum(x["hidden_states"].view(torch.uint8).numpy().tobytes()) for x in (a, b)]
    assert torch.equal(a["hidden_states"], b["hidden_states"]) and same[0] == same[1]
    assert b["metadata"]["hscapture.compression"] == "byteplane-zstd/1"
    with pytest.raises(ConfigError, match="zstd takes 1..=22"):
        _native.CaptureSession(
            [1],
            "after",
            4,
            H,
            "float32",
            "float32",
            assemble=True,
            output=_native.Output(directory(tmp_path / "x", compress=40)),
        )


def _two_steps(s):
    run(
        s,
        sched(new=[new_req("a", [1, 2, 3], 0), new_req("b", [4, 5, 6, 7, 8], 1)], n={"a": 3, "b": 2}),
        ["b", "a"],
        rows_tagged,
    )
    run(s, sched(cached=[("a", 3), ("b", 2)], n={"a": 1, "b": 3}), ["a", "b"], rows_tagged)


def test_background_assembly_writes_what_inline_writes(tmp_path):
    written = {}
    for mode in ("inline", "background"):
        s = session(tmp_path / mode)
        if mode == "background":
            s.set_background(3)
        assert s.background == (mode == "background")
        _two_steps(s)
        written[mode] = sorted((r["file"], r["checksum"], r["length"]) for r in s.finish())
    assert len(written["inline"]) == 2 and written["background"] == written["inline"]


def test_background_samples_in_memory_are_all_there_when_taken():
    inline, bg = session(), session()
    bg.set_background(2)
    for s in (inline, bg):
        _two_steps(s)
    key = lambda d: d["sample"]  # noqa: E731
    assert sorted(bg.take_samples(), key=key) == sorted(inline.take_samples(), key=key)
    with pytest.raises(ConfigError, match="before the first step"):
        bg.set_background(2)


def test_assembly_mode_and_ring_come_from_the_environment(monkeypatch):
    from hscapture.capture.wiring import assembly_ring as _assembly_ring

    assert _assembly_ring() == 2
    monkeypatch.setenv("HSCAPTURE_HOST_RING", "4")
    assert _assembly_ring() == 4
    monkeypatch.setenv("HSCAPTURE_HOST_RING", "1")
    with pytest.raises(ConfigError, match="at least 2"):
        _assembly_ring()
    monkeypatch.setenv("HSCAPTURE_ASSEMBLY", "inline")
    assert _assembly_ring() == 0
    monkeypatch.setenv("HSCAPTURE_ASSEMBLY", "threads")
    with pytest.raises(ConfigError, match="background` or `inline"):
        _assembly_ring()


def test_an_io_error_reaches_python_as_the_cause_with_its_errno(tmp_path):
    """Errors keep their source: an OutputError from the file system has the OSError (with its errno) as its
    ``__cause__``, so a caller can tell a missing file or a full disk from anything else."""
    import errno

    with pytest.raises(OutputError) as e:
        _native.read_sample(str(tmp_path / "nowhere" / "hs_0.safetensors"))
    assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == errno.ENOENT
    with pytest.raises(OutputError) as e:
        _native.read_manifest(str(tmp_path / "manifest.json"))
    assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == errno.ENOENT
