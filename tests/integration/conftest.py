"""Integration tests: real vLLM on CPU, real tiny models, real files, HF transformers as the oracle."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="integration tests need vLLM (run scripts/setup.sh)")

HERE = Path(__file__).resolve().parent

# Workers are spawned processes: let them import the test-only worker classes in this folder.
os.environ["PYTHONPATH"] = str(HERE) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import sitecustomize  # noqa: E402, F401 - this process too (Python imported its own before the path was set)

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, tiny_model):
    """A prepared dataset (speculators' layout) of ROWS samples of 2..120 tokens, and hscapture's offline capture
    (shared by the connector and Mooncake tests)."""
    import random

    from connector_support import ROWS, extract, speculators

    speculators()
    datasets = pytest.importorskip("datasets", reason="the prepared dataset needs `datasets` (scripts/setup.sh)")
    model = tiny_model("llama", "float32")
    rng = random.Random(11)
    ids = [[rng.randrange(4, 1000) for _ in range(rng.randint(2, 120))] for _ in range(ROWS)]
    root = tmp_path_factory.mktemp("connector")
    data = root / "dataset"
    ds = datasets.Dataset.from_dict(
        {"input_ids": ids, "loss_mask": [[1] * len(r) for r in ids], "seq_len": [len(r) for r in ids]}
    )
    ds.set_format(type="torch")
    ds.save_to_disk(str(data))
    offline = root / "offline"
    r = extract(model, data, offline, "--vllm-arg", "max_num_seqs=1")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return model, root, data, ids, offline
