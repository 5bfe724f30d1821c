"""The progress line's GB estimate (``cli/extract.py::_bytes_per_token``) uses the dtype the states are stored in:
the store dtype, else the dtype vLLM runs the model in (reliability row 73)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hscapture.cli.extract import ExtractOptions, _bytes_per_token


def _llm(dtype: str):
    return SimpleNamespace(llm_engine=SimpleNamespace(model_config=SimpleNamespace(dtype=dtype)))


@pytest.mark.parametrize(
    "store,engine,want",
    [
        ("auto", "torch.float32", 4),  # the model's dtype when nothing else is asked
        ("auto", "torch.bfloat16", 2),
        ("float32", "torch.bfloat16", 4),  # the store dtype wins
        ("bfloat16", "torch.float32", 2),
    ],
)
def test_the_estimate_uses_the_stored_dtype(store, engine, want):
    opts = ExtractOptions(model="m", prompts=[[1]], out="/x", convention="after", store_dtype=store)
    assert _bytes_per_token(_llm(engine), {"hidden_size": 64}, opts, 3) == 3 * 64 * want
