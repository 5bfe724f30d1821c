"""--format legacy: data_{i}.pt as speculators 0.3/0.4 wrote it, written by the core's writer atomically (torch
not involved), read back by torch.load (mmap or not) and by hscapture, verified, kept on resume by its ledger,
and read by speculators 0.4's own trainer dataset where it is installed."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from hscapture import _native, load_sample
from hscapture.adapters.vllm_compat import LOSS_MASK_KEY, SAMPLE_KEY, step_of
from hscapture.output import formats
from support import directory, sched

H, N = 16, 3
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
LAYERS = [1, 2, 4]  # before convention on a 4-layer model: the last is the final layer


def req(rid, ids, sample, mask=None):
    extra = {SAMPLE_KEY: sample, **({LOSS_MASK_KEY: mask} if mask is not None else {})}
    return SimpleNamespace(
        req_id=rid, prompt_token_ids=ids, num_computed_tokens=0, sampling_params=SimpleNamespace(extra_args=extra)
    )


def capture(root, masks=None, dtype="bfloat16"):
    """What a legacy run's writing rank leaves: data_{i}.pt and its journal; then the driver's documents and
    manifest. Returns each sample's states [L, n, H] as they were captured."""
    masks = masks or {}
    s = _native.CaptureSession(
        LAYERS,
        "before",
        4,
        H,
        "float32",
        dtype,
        assemble=True,
        output=_native.Output(directory(root, durable=True, format="legacy"), model="m"),
    )
    states = {}
    for i, p in enumerate(PROMPTS):
        so = sched(new=[req(f"r{i}", p, i, masks.get(i))], n={f"r{i}": len(p)})
        s.begin_step(step_of(so))
        s.plan([f"r{i}"])
        g = torch.Generator().manual_seed(i)
        layers = [torch.randn(len(p), H, generator=g) for _ in LAYERS]
        for slot, h in enumerate(layers):
            s.capture(slot, h)
        states[i] = torch.stack(layers, dim=1).to(getattr(torch, dtype))
        s.end_step()
        s.release()  # no other rank to agree with
    records = sorted(s.finish(), key=lambda r: r["index"])
    manifest = {
        "format": _native.MANIFEST_FORMAT,
        "sample_format": "legacy",
        "model": "m",
        "layer_ids": LAYERS,
        "convention": "before",
        "dtype": dtype,
        "hidden_size": H,
        "num_hidden_layers": 4,
        "tensor_parallel_size": 1,
        "created_by": {},
        "samples": records,
    }
    formats.get("legacy").write_documents(
        root,
        records,
        manifest,
        formats.RunInfo(
            model="m",
            input_path="in.jsonl",
            num_samples=3,
            seq_length=8,
            tp=1,
            gpu_memory_utilization=None,
            durable=True,
        ),
    )
    _native.write_manifest(str(root / "manifest.json"), json.dumps(manifest))
    return states, records


def test_a_file_is_the_04_layout(tmp_path):
    states, records = capture(tmp_path, masks={0: [0, 1, 1, 0]})
    names = sorted(os.listdir(tmp_path))
    assert names == [
        ".hscapture.writer.lock",
        "data_0.pt",
        "data_1.pt",
        "data_2.pt",
        "data_config.json",
        "manifest.json",
        "records.jsonl",
        "sample_lengths.json",
    ], "no temporary left, no staging folder"
    for mmap in (False, True):
        d = torch.load(tmp_path / "data_0.pt", weights_only=True, mmap=mmap)
        assert sorted(d) == ["hidden_states", "input_ids", "loss_mask"]
        assert d["input_ids"].dtype == torch.long and d["input_ids"].tolist() == PROMPTS[0]
        assert d["loss_mask"].dtype == torch.long and d["loss_mask"].tolist() == [0, 1, 1, 0]
        assert isinstance(d["hidden_states"], list) and len(d["hidden_states"]) == N
        for k, t in enumerate(d["hidden_states"]):
            assert t.dtype == torch.bfloat16 and tuple(t.shape) == (4, H) and torch.equal(t, states[0][:, k, :])
            assert t.untyped_storage().nbytes() == 4 * H * 2, "each layer saved alone, not the whole sample per layer"
    raw = (tmp_path / "data_0.pt").read_bytes()
    assert records[0] == {
        "index": 0,
        "request_id": None,
        "file": "data_0.pt",
        "length": 4,
        "checksum": _native.checksum(raw),
        "bytes": len(raw),
    }, "the checksum covers the whole file"
    back = load_sample(tmp_path / "data_0.pt")
    assert torch.equal(back["hidden_states"], states[0]) and back["loss_mask"].tolist() == [0, 1, 1, 0]


def test_no_mask_means_every_token(tmp_path):
    capture(tmp_path)
    assert torch.load(tmp_path / "data_1.pt", weights_only=True)["loss_mask"].tolist() == [1, 1]


def test_documents_resume_and_verify(tmp_path):
    _, records = capture(tmp_path)
    assert json.loads((tmp_path / "sample_lengths.json").read_text()) == {"0": 4, "1": 2, "2": 3}
    cfg = json.loads((tmp_path / "data_config.json").read_text())
    assert cfg["version"] == "2.0" and cfg["format"]["file_pattern"] == "data_{idx}.pt"
    assert cfg["hidden_states"]["layer_ids"] == [0, 1, 3], "speculators 0.3/0.4 ids are after-layer ids"
    assert cfg["format"]["schema"]["hidden_states"]["num_tensors"] == N and cfg["data"]["num_samples"] == 3
    identity = json.dumps(
        {
            "format": "legacy",
            "model": "m",
            "layer_ids": LAYERS,
            "convention": "before",
            "dtype": "bfloat16",
            "hidden_size": H,
            "num_hidden_layers": 4,
        }
    )
    kept, recapture, _ = _native.resume_plan(str(tmp_path), identity)
    assert sorted(kept) == [0, 1, 2] and not recapture
    assert kept[0][0] == records[0] and kept[2][1] == PROMPTS[2]
    assert _native.verify_dir(str(tmp_path)) == (3, 9, sum(r["bytes"] for r in records), [])

    (tmp_path / "data_9.pt").write_bytes(b"x")
    (tmp_path / ".data_1.pt.partial-5").write_bytes(b"x")
    d = torch.load(tmp_path / "data_2.pt", weights_only=True)
    d["hidden_states"][1][0, 0] = float("nan")
    torch.save(d, tmp_path / "data_2.pt")  # another writer's archive, with a NaN
    (tmp_path / "data_1.pt").write_bytes((tmp_path / "data_1.pt").read_bytes()[:100])
    _, _, _, problems = _native.verify_dir(str(tmp_path))
    text = "\n".join(problems)
    assert "sample 1: data_1.pt:" in text and "truncated" in text
    assert "sample 2: data_2.pt:" in text and "not written by hscapture" in text
    assert "data_9.pt is not in the manifest" in text and "leftover partial file .data_1.pt.partial-5" in text
    m = json.loads(_native.read_manifest(str(tmp_path / "manifest.json")))
    (tmp_path / "sample_lengths.json").write_text('{"0": 4}')
    assert "sample 1 (data_1.pt): sample_lengths.json says None" in "\n".join(
        formats.get("legacy").check_documents(tmp_path, m)
    )
    kept, recapture, _ = _native.resume_plan(str(tmp_path), identity)
    assert sorted(kept) == [0], "damaged files are captured again, never kept"
    assert [r.split(" (")[0] for r in recapture] == ["sample 1", "sample 2", "sample 9"], recapture


def test_a_refused_resume_names_the_settings_that_differ(tmp_path):
    capture(tmp_path)
    other = json.dumps(
        {
            "format": "legacy",
            "model": "m",
            "layer_ids": [2, 4],
            "convention": "before",
            "dtype": "bfloat16",
            "hidden_size": H,
            "num_hidden_layers": 4,
        }
    )
    with pytest.raises(Exception, match=r"layer ids: \[1, 2, 4\] vs \[2, 4\]"):
        _native.resume_plan(str(tmp_path), other)


def test_the_outdir_replaces_only_what_a_run_wrote(tmp_path):
    from hscapture.cli import outdir

    capture(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    aside = outdir.prepare(tmp_path, overwrite=True, fmt=formats.get("legacy"))
    assert sorted(os.listdir(tmp_path)) == [outdir.ASIDE, ".hscapture.writer.lock", "notes.txt"], (
        "the capture moved aside, the rest untouched"
    )
    outdir.restore(tmp_path, aside)
    assert "data_0.pt" in os.listdir(tmp_path) and outdir.ASIDE not in os.listdir(tmp_path), "a failed start restores"
    outdir.discard(outdir.prepare(tmp_path, overwrite=True, fmt=formats.get("legacy")))
    assert sorted(os.listdir(tmp_path)) == [".hscapture.writer.lock", "notes.txt"]


READER = """
import json, sys, torch
from speculators.train.data import Eagle3SampleFileDataset
ds = Eagle3SampleFileDataset(max_len=16, datapath=sys.argv[1], hidden_states_dtype=torch.bfloat16)
items = {str(f).rsplit('/', 1)[-1]: ds[k] for k, f in enumerate(ds.data)}
print(json.dumps({"lengths": sorted(ds.approx_lengths), "files": sorted(items),
                  "shapes": {n: [list(it["hidden_states"].shape), list(it["verifier_last_hidden_states"].shape),
                                 it["input_ids"].tolist(), it["loss_mask"].tolist()] for n, it in items.items()}}))
"""


def test_speculators_04_trainer_reads_it(tmp_path):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    from support import speculators_path

    path = speculators_path("0.4.0")
    if path is None:
        pytest.skip("speculators 0.4.0 is not installed in <venv>/speculators-0.4.0 (scripts/setup.sh)")
    capture(tmp_path, masks={0: [0, 1, 1, 1]})
    r = subprocess.run(
        [sys.executable, "-c", READER, str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(path)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["files"] == ["data_0.pt", "data_1.pt", "data_2.pt"], (
        "only the samples: no document or temporary is a *pt file"
    )
    assert got["lengths"] == [2, 3, 4], "exact lengths from sample_lengths.json"
    hs, last, ids, mask = got["shapes"]["data_0.pt"]
    assert hs == [3, (N - 1) * H] and last == [3, H], "aux layers concatenated, the last layer as the verifier's"
    assert ids == PROMPTS[0][1:] and mask == [1, 1, 1], "its shift_batch drops the first token"


def test_a_resume_with_the_input_cut_short_is_refused(tmp_path):
    from hscapture import ConfigError
    from hscapture.cli import extract
    from hscapture.cli.inputs import PromptSet

    capture(tmp_path)
    identity = {
        "format": "legacy",
        "model": "m",
        "layer_ids": LAYERS,
        "convention": "before",
        "dtype": "bfloat16",
        "hidden_size": H,
        "num_hidden_layers": 4,
    }
    done, found = extract._resume(tmp_path, PromptSet.from_lists(PROMPTS), {0, 1, 2}, identity)
    assert sorted(done) == [0, 1, 2] and found["layer_ids"] == LAYERS
    with pytest.raises(ConfigError, match=r"finished samples \[2\] beyond this input's 2 rows"):
        extract._resume(tmp_path, PromptSet.from_lists(PROMPTS[:2]), {0, 1}, identity)
    changed = [PROMPTS[0], [1, 2], PROMPTS[2]]
    with pytest.raises(Exception, match=r"holds tokens that are not prompt 1"):
        extract._resume(tmp_path, PromptSet.from_lists(changed), {0, 1, 2}, identity)
