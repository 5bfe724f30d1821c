"""What one request carries to the workers (its sampling parameters' extra arguments, its ``kv_transfer_params``)
is read strictly: a value a client sent with the wrong type is ignored for that request, never raised into the
capture (which would stop a server for every client)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hscapture.adapters.vllm_compat import (
    LOSS_MASK_KEY,
    SAMPLE_KEY,
    include_output_tokens,
    loss_mask,
    sample_index,
    step_args,
)


def _sp(extra):
    return SimpleNamespace(extra_args=extra)


@pytest.mark.parametrize("v", ["3", 3.0, -1, 2**63, True, [1], {"a": 1}])
def test_a_wrong_sample_index_is_ignored(v, caplog):
    assert sample_index(_sp({SAMPLE_KEY: v})) is None
    assert SAMPLE_KEY in caplog.text


def test_the_drivers_sample_index_and_mask_are_kept():
    sp = _sp({SAMPLE_KEY: 7, LOSS_MASK_KEY: [0, 1, 1]})
    assert sample_index(sp) == 7 and loss_mask(sp) == [0, 1, 1]
    assert sample_index(_sp(None)) is None and loss_mask(_sp("not a dict")) is None


@pytest.mark.parametrize("v", ["0101", [0, 2], [0.0, 1.0], [True, False], 5, [[0]]])
def test_a_wrong_loss_mask_is_ignored(v, caplog):
    assert loss_mask(_sp({LOSS_MASK_KEY: v})) is None
    assert LOSS_MASK_KEY in caplog.text


@pytest.mark.parametrize(
    "params,want",
    [
        ({"include_output_tokens": True}, True),
        ({"include_output_tokens": "false"}, False),  # bool("false") is True: only JSON true asks for it
        ({"include_output_tokens": 1}, False),
        ({"include_output_tokens": False}, False),
        (["include_output_tokens"], False),
        ("include_output_tokens", False),
        (None, False),
    ],
)
def test_include_output_tokens_is_json_true_only(params, want):
    assert include_output_tokens(params) is want


def test_a_step_with_hostile_arguments_becomes_plain_arguments():
    """The scheduler output of a step whose new request sent garbage: step_args does not raise."""
    new = SimpleNamespace(
        req_id="cmpl-x",
        prompt_token_ids=[1, 2, 3],
        num_computed_tokens=0,
        sampling_params=_sp({SAMPLE_KEY: "zero", LOSS_MASK_KEY: {"x": 1}, "kv_transfer_params": 42}),
    )
    so = SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[], new_token_ids=[]),
        num_scheduled_tokens={"cmpl-x": 3},
        total_num_scheduled_tokens=3,
        finished_req_ids=set(),
        kv_connector_metadata=None,
    )
    args = step_args(so)
    assert args[0][0] == ("cmpl-x", [1, 2, 3], 0, None, None)
