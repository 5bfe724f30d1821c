"""--shard k/n and `hscapture merge`: global indices kept, shards of one run joined, every mismatch refused."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from hscapture import ConfigError, OutputError, _native
from hscapture.cli.merge import run_merge
from hscapture.cli.shard import Shard, ShardInfo, check_resume
from support import directory, new_req, sched

ROWS, H = 5, 8


def make_shard(root, k, n, rows=ROWS, indices=None, fingerprint="xxh3:abc", dtype="bfloat16", fmt="hscapture"):
    """A finished shard directory as `extract --shard k/n` leaves it."""
    (root / "hidden_states").mkdir(parents=True)
    records = []
    for i in indices if indices is not None else range(k, rows, n):
        token_rows = torch.arange(i + 1, dtype=torch.float32).view(-1, 1, 1)  # one row per token, each different
        hs = (float(i) + token_rows).expand(i + 1, 2, H).contiguous().to(getattr(torch, dtype))
        f = root / "hidden_states" / f"hs_{i}.safetensors"
        save_file({"hidden_states": hs, "token_ids": torch.arange(i + 1, dtype=torch.int64)}, str(f))
        s = _native.read_sample(str(f))
        records.append(
            {
                "index": i,
                "file": f"hidden_states/hs_{i}.safetensors",
                "length": i + 1,
                "checksum": s["checksum"],
                "bytes": f.stat().st_size,
            }
        )
    m = {
        "format": _native.MANIFEST_FORMAT,
        "model": "/models/tiny",
        "layer_ids": [1, 3],
        "convention": "after",
        "dtype": dtype,
        "hidden_size": H,
        "num_hidden_layers": 4,
        "tensor_parallel_size": 1,
        "created_by": {},
        "samples": records,
    }
    _native.write_manifest(str(root / "manifest.json"), json.dumps(m))
    ShardInfo(k, n, rows, "in.jsonl", fingerprint, fmt).write(root)
    return root


def test_shard_spec():
    assert Shard.parse("1/3").rows(8) == [1, 4, 7] and str(Shard.parse("0/1")) == "0/1"
    for bad in ("3/3", "-1/2", "a/b", "1", "0/0"):
        with pytest.raises(ConfigError, match="--shard"):
            Shard.parse(bad)


def test_resume_must_be_the_same_shard(tmp_path):
    a = ShardInfo(0, 2, 10, "x", "xxh3:1", "hscapture")
    check_resume(tmp_path, None)
    check_resume(tmp_path, a)  # killed before shard.json was written
    a.write(tmp_path)
    check_resume(tmp_path, ShardInfo(0, 2, 10, "elsewhere/x", "xxh3:1", "hscapture"))  # the same input, moved
    with pytest.raises(ConfigError, match=r"holds shard 0/2; this run is unsharded: resume with --shard 0/2"):
        check_resume(tmp_path, None)
    with pytest.raises(ConfigError, match=r"shard: 0 vs 1"):
        check_resume(tmp_path, ShardInfo(1, 2, 10, "x", "xxh3:1", "hscapture"))
    with pytest.raises(ConfigError, match=r"input_fingerprint"):
        check_resume(tmp_path, ShardInfo(0, 2, 10, "x", "xxh3:2", "hscapture"))


def test_merge_links_every_file_and_writes_one_manifest(tmp_path):
    s0, s1 = make_shard(tmp_path / "s0", 0, 2), make_shard(tmp_path / "s1", 1, 2)
    rep = run_merge(tmp_path / "out", [s1, s0])
    assert (rep.samples, rep.linked, rep.copied, rep.moved, rep.tokens) == (ROWS, ROWS, 0, 0, 15)
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [s["index"] for s in m["samples"]] == list(range(ROWS)) and m["created_by"]["merge"] == "2 shards"
    assert (
        os.stat(tmp_path / "out/hidden_states/hs_3.safetensors").st_ino
        == os.stat(s1 / "hidden_states/hs_3.safetensors").st_ino
    )
    samples, _, _, problems = _native.verify_dir(str(tmp_path / "out"))
    assert samples == ROWS and problems == []
    assert not (tmp_path / "out" / "shard.json").exists()
    with pytest.raises(OutputError, match="already holds a capture"):
        run_merge(tmp_path / "out", [s0, s1])


def test_merge_can_move_and_be_run_again_after_an_interruption(tmp_path):
    s0, s1 = make_shard(tmp_path / "s0", 0, 2), make_shard(tmp_path / "s1", 1, 2)
    out = tmp_path / "out"
    (out / "hidden_states").mkdir(parents=True)
    os.replace(s0 / "hidden_states/hs_2.safetensors", out / "hidden_states/hs_2.safetensors")  # moved, then killed
    rep = run_merge(out, [s0, s1], move=True)
    assert rep.moved == ROWS and not any((s0 / "hidden_states").iterdir())
    assert _native.verify_dir(str(out))[3] == []


@pytest.mark.parametrize(
    "case,match",
    [
        ("dtype", r"differ in dtype"),
        ("fingerprint", r"differ in input fingerprint"),
        ("twice", r"shard 0/2 is given twice"),
        ("missing_shard", r"shards \[1\] of 2 are missing"),
        ("missing_index", r"1 of 5 rows have no sample in any shard \(first: \[3\]\).*--resume"),
        ("foreign_index", r"lists sample 1, which is not a row of shard 0/3"),
        ("unfinished", r"has no manifest.json: that shard did not finish.*--resume"),
        ("not_a_shard", r"has no shard.json"),
    ],
)
def test_merge_refuses(tmp_path, case, match):
    s0 = make_shard(tmp_path / "s0", 0, 2)
    second = {
        "dtype": lambda: make_shard(tmp_path / "s1", 1, 2, dtype="float32"),
        "fingerprint": lambda: make_shard(tmp_path / "s1", 1, 2, fingerprint="xxh3:def"),
        "twice": lambda: make_shard(tmp_path / "s1", 0, 2),
        "missing_shard": None,
        "missing_index": lambda: make_shard(tmp_path / "s1", 1, 2, indices=[1]),
        "foreign_index": lambda: (
            make_shard(tmp_path / "s1", 1, 2),
            make_shard(tmp_path / "s2", 0, 3, rows=ROWS, indices=[0, 1]),
        )[1],
        "unfinished": lambda: (make_shard(tmp_path / "s1", 1, 2) / "manifest.json").unlink() or tmp_path / "s1",
        "not_a_shard": lambda: (make_shard(tmp_path / "s1", 1, 2) / "shard.json").unlink() or tmp_path / "s1",
    }[case]
    dirs = [s0] + ([second()] if second else [])
    if case == "foreign_index":
        dirs = [dirs[1], make_shard(tmp_path / "s3", 1, 3), make_shard(tmp_path / "s4", 2, 3)]
    with pytest.raises((ConfigError, OutputError), match=match):
        run_merge(tmp_path / "out", dirs)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_merge_checks_file_sizes_against_the_manifest(tmp_path):
    s0, s1 = make_shard(tmp_path / "s0", 0, 2), make_shard(tmp_path / "s1", 1, 2)
    with open(s1 / "hidden_states/hs_1.safetensors", "ab") as f:
        f.write(b"junk")
    with pytest.raises(OutputError, match=r"hs_1.safetensors has \d+ bytes, its manifest says \d+"):
        run_merge(tmp_path / "out", [s0, s1])
    with pytest.raises(ConfigError, match="is one of the shards"):
        run_merge(s0, [s0, s1])


def test_merge_legacy_shards(tmp_path):
    from hscapture.adapters.vllm_compat import step_of
    from hscapture.output import formats

    dirs = []
    for k in (0, 1):
        root = tmp_path / f"s{k}"
        s = _native.CaptureSession(
            [1, 3],
            "after",
            4,
            H,
            "float32",
            "bfloat16",
            assemble=True,
            output=_native.Output(directory(root, durable=False, format="legacy"), model="/models/tiny"),
        )
        for i in range(k, ROWS, 2):
            so = sched(new=[new_req(f"r{i}", list(range(i + 1)), i)], n={f"r{i}": i + 1})
            s.begin_step(step_of(so))
            s.plan([f"r{i}"])
            for slot in range(2):
                s.capture(slot, float(i) + torch.arange(i + 1, dtype=torch.float32).view(-1, 1).expand(i + 1, H))
            s.end_step()
            s.release()
        records = sorted(s.finish(), key=lambda r: r["index"])
        meta = {"layer_ids": [1, 3], "convention": "after", "dtype": "bfloat16", "hidden_size": H}
        m = {
            "format": _native.MANIFEST_FORMAT,
            "sample_format": "legacy",
            "model": "/models/tiny",
            **meta,
            "num_hidden_layers": 4,
            "tensor_parallel_size": 1,
            "created_by": {},
            "samples": records,
        }
        formats.get("legacy").write_documents(
            root,
            records,
            m,
            formats.RunInfo(
                model="/models/tiny",
                input_path="in.jsonl",
                num_samples=len(records),
                seq_length=8,
                tp=1,
                gpu_memory_utilization=None,
                durable=False,
            ),
        )
        _native.write_manifest(str(root / "manifest.json"), json.dumps(m))
        ShardInfo(k, 2, ROWS, "in.jsonl", "xxh3:abc", "legacy").write(root)
        dirs.append(root)
    rep = run_merge(tmp_path / "out", dirs)
    assert rep.samples == ROWS
    out = tmp_path / "out"
    assert json.loads((out / "sample_lengths.json").read_text()) == {str(i): i + 1 for i in range(ROWS)}
    assert json.loads((out / "data_config.json").read_text())["data"]["num_samples"] == ROWS
    assert _native.verify_dir(str(out))[3] == [] and _native.verify_dir(str(out))[0] == ROWS
    with pytest.raises(ConfigError, match="differ in format"):
        run_merge(tmp_path / "mixed", [dirs[0], make_shard(tmp_path / "h1", 1, 2)])
