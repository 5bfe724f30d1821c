"""--format legacy: data_{i}.pt as speculators 0.3/0.4 wrote it, written atomically, re-read on resume, verified,
and read by speculators 0.4's own trainer dataset where it is installed."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from hscapture import OutputError, _native
from hscapture.cli import legacy
from hscapture.cli.inputs import PromptSet

H, N = 16, 3
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


def stage(root, i, tokens, seed=0):
    d = root / legacy.STAGING / "hidden_states"
    d.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed + i)
    hs = torch.randn(len(tokens), N, H, generator=g).to(torch.bfloat16)
    save_file({"hidden_states": hs, "token_ids": torch.tensor(tokens, dtype=torch.int64)}, str(d / f"hs_{i}.safetensors"))
    return d / f"hs_{i}.safetensors", hs


def capture(root, masks=None):
    """What a legacy run leaves: data_{i}.pt, sidecars and a manifest."""
    ps = PromptSet.from_lists(PROMPTS)
    ps._masks = masks or {}
    conv = legacy.Converter(root, ps, durable=True)
    states = {}
    for i, p in enumerate(PROMPTS):
        _, states[i] = stage(root, i, p)
        conv.finished(i)
    conv.drain(range(len(PROMPTS)))
    records = [conv.records[i] for i in range(len(PROMPTS))]
    meta = {"layer_ids": [1, 2, 4], "convention": "before", "dtype": "bfloat16", "hidden_size": H}
    legacy.write_sidecars(root, records, meta, model="m", input_path="in.jsonl", num_samples=3, seq_length=8, tp=1,
                          gpu_memory_utilization=None, durable=True)
    manifest = {"format": "hscapture/1", "model": "m", "layer_ids": [1, 2, 4], "convention": "before", "dtype": "bfloat16",
                "hidden_size": H, "num_hidden_layers": 4, "tensor_parallel_size": 1, "created_by": {}, "samples": records}
    _native.write_manifest(str(root / "manifest.json"), json.dumps(manifest))
    (root / legacy.STAGING / "hidden_states").rmdir()
    (root / legacy.STAGING).rmdir()
    return states, records


def test_a_converted_file_is_the_04_layout(tmp_path):
    staged, hs = stage(tmp_path, 0, PROMPTS[0])
    want = _native.read_sample(str(staged))["checksum"]
    rec = legacy.convert(staged, tmp_path, 0, [0, 1, 1, 0], durable=True)
    assert not staged.exists() and sorted(os.listdir(tmp_path)) == [legacy.STAGING, "data_0.pt"], "no temporary left"
    d = torch.load(tmp_path / "data_0.pt", weights_only=True)
    assert sorted(d) == ["hidden_states", "input_ids", "loss_mask"]
    assert d["input_ids"].dtype == torch.long and d["input_ids"].tolist() == PROMPTS[0]
    assert d["loss_mask"].dtype == torch.long and d["loss_mask"].tolist() == [0, 1, 1, 0]
    assert isinstance(d["hidden_states"], list) and len(d["hidden_states"]) == N
    for k, t in enumerate(d["hidden_states"]):
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == (4, H) and torch.equal(t, hs[:, k, :])
        assert t.untyped_storage().nbytes() == 4 * H * 2, "each layer saved alone, not the whole sample per layer"
    assert rec == {"index": 0, "file": "data_0.pt", "length": 4, "checksum": want, "bytes": (tmp_path / "data_0.pt").stat().st_size}
    assert legacy.checksum_of(legacy.states_of(legacy.load(tmp_path / "data_0.pt"))) == want


def test_no_mask_means_every_token(tmp_path):
    staged, _ = stage(tmp_path, 1, PROMPTS[1])
    legacy.convert(staged, tmp_path, 1, None, durable=False)
    assert torch.load(tmp_path / "data_1.pt", weights_only=True)["loss_mask"].tolist() == [1, 1]


def test_sidecars_resume_scan_and_verify(tmp_path):
    _, records = capture(tmp_path)
    assert json.loads((tmp_path / "sample_lengths.json").read_text()) == {"0": 4, "1": 2, "2": 3}
    cfg = json.loads((tmp_path / "data_config.json").read_text())
    assert cfg["version"] == "2.0" and cfg["format"]["file_pattern"] == "data_{idx}.pt"
    assert cfg["hidden_states"]["layer_ids"] == [0, 1, 3], "speculators 0.3/0.4 ids are after-layer ids"
    assert cfg["format"]["schema"]["hidden_states"]["num_tensors"] == N and cfg["data"]["num_samples"] == 3
    found, skipped = legacy.scan_finished(tmp_path, {0, 2})
    assert sorted(found) == [0, 2] and not skipped
    assert found[0][0] == records[0] and found[2][1] == PROMPTS[2]
    assert legacy.is_legacy(tmp_path)
    assert legacy.verify_dir(tmp_path) == (3, 9, sum(r["bytes"] for r in records), [])

    (tmp_path / "data_9.pt").write_bytes(b"x")
    (tmp_path / ".data_1.pt.partial-5").write_bytes(b"x")
    d = torch.load(tmp_path / "data_2.pt", weights_only=True)
    d["hidden_states"][1][0, 0] = float("nan")
    torch.save(d, tmp_path / "data_2.pt")
    (tmp_path / "data_1.pt").write_bytes((tmp_path / "data_1.pt").read_bytes()[:100])
    _, _, _, problems = legacy.verify_dir(tmp_path)
    text = "\n".join(problems)
    assert "sample 1 (data_1.pt): cannot be loaded" in text
    assert "sample 2 (data_2.pt): checksum" in text and "sample 2 (data_2.pt): 1 NaN/Inf values" in text
    assert "data_9.pt is not in the manifest" in text and "leftover partial file .data_1.pt.partial-5" in text
    found, skipped = legacy.scan_finished(tmp_path, {0, 1, 2, 9})
    assert sorted(found) == [0, 2] and len(skipped) == 2, "unreadable files are not finished samples"


def test_resume_recovers_staged_files_and_refuses_changed_input(tmp_path):
    ps = PromptSet.from_lists(PROMPTS)
    stage(tmp_path, 1, PROMPTS[1])
    stage(tmp_path, 2, PROMPTS[2])
    (tmp_path / legacy.STAGING / "hidden_states" / ".hs_0.safetensors.partial-3-0").write_bytes(b"x")
    done = {}
    assert legacy.Converter(tmp_path, ps, durable=False).recover({0, 1}, done) == 1
    assert sorted(done) == [1] and (tmp_path / "data_1.pt").exists()
    assert not any((tmp_path / legacy.STAGING / "hidden_states").iterdir()), "partial and other rows' files dropped"
    stage(tmp_path, 0, [1, 2, 3])
    with pytest.raises(OutputError, match=r"hs_0.safetensors holds tokens that are not prompt 0 .*--overwrite"):
        legacy.Converter(tmp_path, ps, durable=False).recover({0}, {})


def test_a_failed_write_leaves_nothing_and_says_what_to_do(tmp_path):
    def fail(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OutputError, match=r"cannot write .*data_0.pt: .*No space left.*--resume"):
        legacy.write_atomic(tmp_path / "data_0.pt", True, fail)
    assert os.listdir(tmp_path) == []


def test_overwrite_removes_only_what_a_legacy_run_wrote(tmp_path):
    capture(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    legacy.remove(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["manifest.json", "notes.txt"]


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
    states, _ = capture(tmp_path, masks={0: [0, 1, 1, 1]})
    r = subprocess.run([sys.executable, "-c", READER, str(tmp_path)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(path)})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["files"] == ["data_0.pt", "data_1.pt", "data_2.pt"], "only the samples: no sidecar or temporary is a *pt file"
    assert got["lengths"] == [2, 3, 4], "exact lengths from sample_lengths.json"
    hs, last, ids, mask = got["shapes"]["data_0.pt"]
    assert hs == [3, (N - 1) * H] and last == [3, H], "aux layers concatenated, the last layer as the verifier's"
    assert ids == PROMPTS[0][1:] and mask == [1, 1, 1], "its shift_batch drops the first token"
