"""speculators' prepared dataset in, its training's layout out: `hs_{i}` is row `i`, `token_ids` equal that row's
`input_ids`, the final layer last; read back with speculators' own reader where it is installed and always with a
reader built from the documented format. Shards of the same input merge into the same capture."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.integration
datasets = pytest.importorskip("datasets", reason="the prepared-dataset input needs `datasets` (scripts/setup.sh)")

CMD = [sys.executable, "-m", "hscapture.cli.main"]
LAYERS = [1, 2, 4]  # before convention; 4 = num_hidden_layers of the tiny llama = the final layer
ROWS = 7


def run(*args, **kw):
    return subprocess.run(CMD + [str(a) for a in args], capture_output=True, text=True, **kw)


def extract(model, inp, out, *extra):
    return run(
        "extract",
        "--model",
        model,
        "--input",
        inp,
        "--out",
        out,
        "--layers",
        ",".join(map(str, LAYERS)),
        "--convention",
        "before",
        "--dtype",
        "float32",
        "--store-dtype",
        "bfloat16",
        "--max-num-batched-tokens",
        "32",
        *extra,
    )


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_model):
    """A prepared dataset captured in place (speculators reads <data_path>/hidden_states/hs_{i})."""
    model = tiny_model("llama")
    rng = random.Random(7)
    ids = [[rng.randrange(4, 1024) for _ in range(rng.randint(3, 45))] for _ in range(ROWS)]
    masks = [[int(rng.random() < 0.6) for _ in r] for r in ids]
    d = tmp_path_factory.mktemp("prepared") / "dataset"
    ds = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks, "seq_len": [len(r) for r in ids]})
    ds.set_format(type="torch")  # as speculators' prepare_data saves it
    ds.save_to_disk(str(d))
    r = extract(model, d, d)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return model, d, ids, masks, r.stdout


def test_the_documented_format(prepared):
    """formats.md: hidden_states [L, n_aux + 1, H] bf16, final layer last, token_ids == input_ids, all finite."""
    from safetensors.torch import load_file

    from hscapture.testing import reference

    model, d, ids, _, stdout = prepared
    assert f"samples     {ROWS}" in stdout and "checks      layer ids [1, 2, 4]" in stdout
    m = json.loads((d / "manifest.json").read_text())
    assert m["layer_ids"] == LAYERS and m["convention"] == "before" and m["layer_ids"][-1] == m["num_hidden_layers"]
    for i, row in enumerate(ids):
        f = load_file(str(d / "hidden_states" / f"hs_{i}.safetensors"))
        assert f["token_ids"].dtype == torch.int64 and f["token_ids"].tolist() == row, f"row {i}"
        hs = f["hidden_states"]
        assert hs.dtype == torch.bfloat16 and tuple(hs.shape) == (len(row), len(LAYERS), 128)
        assert bool(torch.isfinite(hs).all())
    # The last slot is the last decoder layer's output before the final norm (HF transformers as the oracle).
    ref = reference.compute_subprocess(model, [ids[0]], [4], "before", d.parent / "ref")[0]
    ours = load_file(str(d / "hidden_states" / "hs_0.safetensors"))["hidden_states"][:, -1:, :].float()
    err = (torch.linalg.vector_norm(ours - ref.float(), dim=-1) / torch.linalg.vector_norm(ref.float(), dim=-1)).max()
    assert float(err) < 1e-2, f"final layer differs from HF's by {float(err):.2e} (bf16 storage)"
    v = run("verify", d)
    assert v.returncode == 0 and "OK" in v.stdout, v.stdout


READER = """
import json, sys, torch
from speculators.train.data import ArrowDataset
from speculators.data_generation.offline import check_hidden_states
ds = ArrowDataset(max_len=64, datapath=sys.argv[1], on_missing="raise", hidden_states_dtype=torch.bfloat16)
out = []
for i in range(len(ds)):
    item = ds[i]
    row = ds.data[i]
    check_hidden_states(ds.transfer.get_cached(i), row["input_ids"].tolist())
    out.append({"input_ids": item["input_ids"].tolist(), "hs": list(item["hidden_states"].shape),
                "last": list(item["verifier_last_hidden_states"].shape), "mask": item["loss_mask"].tolist()})
print(json.dumps(out))
"""


def test_speculators_training_reads_it(prepared):
    from support import speculators_path

    path = speculators_path("0.9.0")
    if path is None or not (path / "hs_connectors").is_dir():
        pytest.skip("speculators 0.9.0 + hs-connectors 0.9.0 are not installed in <venv>/speculators-0.9.0")
    _, d, ids, masks, _ = prepared
    r = subprocess.run(
        [sys.executable, "-c", READER, str(d)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(path)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    items = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(items) == ROWS
    for i, it in enumerate(items):
        L = len(ids[i])
        assert it["input_ids"] == ids[i] and it["mask"] == masks[i], f"row {i}"
        assert it["hs"] == [L, 2 * 128] and it["last"] == [L, 128], "aux layers flattened, the final layer apart"


def test_shards_merge_into_the_unsharded_capture(prepared, tmp_path):
    from hscapture import load_sample

    model, d, ids, _, _ = prepared
    for k in (0, 1):
        executor = ["--executor", "mp"] if k else []  # the pass-through to vLLM's distributed_executor_backend
        r = extract(model, d, tmp_path / f"s{k}", "--shard", f"{k}/2", *executor)
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"shard       {k}/2" in r.stdout
        got = sorted(p.name for p in (tmp_path / f"s{k}" / "hidden_states").iterdir())
        assert got == sorted(f"hs_{i}.safetensors" for i in range(k, ROWS, 2)), "global indices kept"
    r = run("merge", tmp_path / "m", tmp_path / "s1")
    assert r.returncode == 2 and "shards [0] of 2 are missing" in r.stderr, r.stderr
    r = run("merge", tmp_path / "m", tmp_path / "s0", tmp_path / "s1")
    assert r.returncode == 0 and f"samples     {ROWS}" in r.stdout, r.stderr
    v = run("verify", tmp_path / "m")
    assert v.returncode == 0 and "OK" in v.stdout, v.stdout
    m = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert [s["index"] for s in m["samples"]] == list(range(ROWS))
    for i in range(ROWS):
        a = load_sample(tmp_path / "m" / "hidden_states" / f"hs_{i}.safetensors")
        b = load_sample(d / "hidden_states" / f"hs_{i}.safetensors")
        assert a["token_ids"].tolist() == ids[i]
        assert torch.allclose(a["hidden_states"].float(), b["hidden_states"].float(), rtol=2e-2, atol=2e-2), f"row {i}"
