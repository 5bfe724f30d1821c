"""What one request carries to the workers (its sampling parameters' extra arguments, its ``kv_transfer_params``)
is read strictly: a value a client sent with the wrong type is ignored for that request, never raised into the
capture (which would stop a server for every client)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hscapture import _native
from hscapture.adapters.vllm_compat import (
    LOSS_MASK_KEY,
    SAMPLE_KEY,
    include_output_tokens,
    loss_mask,
    sample_index,
    step_of,
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
    """The scheduler output of a step whose new request sent garbage: step_of does not raise."""
    new = SimpleNamespace(
        req_id="cmpl-x",
        prompt_token_ids=[1, 2, 3],
        num_computed_tokens=0,
        sampling_params=SimpleNamespace(
            extra_args={SAMPLE_KEY: "zero", LOSS_MASK_KEY: {"x": 1}, "kv_transfer_params": 42}, max_tokens=5
        ),
    )
    so = SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[], new_token_ids=[]),
        num_scheduled_tokens={"cmpl-x": 3},
        total_num_scheduled_tokens=3,
        finished_req_ids=set(),
        kv_connector_metadata=None,
    )
    step = step_of(so)
    assert step.new_requests == [_native.NewRequest("cmpl-x", [1, 2, 3], 0, max_tokens=5)]
    assert step.new_requests[0].sample is None and step.new_requests[0].loss_mask is None


def test_the_scheduler_refuses_a_growing_sample_by_the_workers_rule():
    """The rule the connector answers with (`hidden_states_error`, no path) is the workers' admission rule, decided
    on the workers' own destination description: rows = prompt + max_tokens - 1 against the bound over the format's
    row bytes (1 MiB of 3 × 128 float32 values = 682 rows; fp8 stores a byte per value and a 4-byte scale per row =
    2702 rows; a store keeps the states as captured). A store is described without its client there, never opened."""
    import pytest

    from hscapture import _native
    from hscapture.errors import ConfigError

    def described(**d):
        return _native.Output.described(d, max_growing_sample_mib=1)

    plain = described(kind="staging", root="/s", format="file")
    assert plain.growing_refusal(3, 128, "float32", "r", 10, 673) is None
    why = plain.growing_refusal(3, 128, "float32", "r", 10, 674)
    assert "683 rows" in why and "HSCAPTURE_MAX_GROWING_SAMPLE_MIB" in why
    fp8 = described(kind="staging", root="/s", format="fp8")
    assert fp8.growing_refusal(3, 128, "bfloat16", "r", 2, 2701) is None
    assert fp8.growing_refusal(3, 128, "bfloat16", "r", 2, 2702) is not None
    store = described(kind="store")
    assert store.growing_refusal(3, 128, "bfloat16", "r", 1, 1365) is None
    assert store.growing_refusal(3, 128, "bfloat16", "r", 1, 1366) is not None
    with pytest.raises(ConfigError, match="a store destination needs its client"):
        _native.Output({"kind": "store"})  # what the workers open must have one


@pytest.mark.parametrize(
    "drafts,async_scheduling,refused",
    [(3, True, True), (3, False, False), (0, True, False), (None, True, False)],
    ids=["drafts-async", "drafts-sync", "no-drafts", "no-speculation"],
)
def test_generated_tokens_are_refused_where_their_positions_are_unknown(drafts, async_scheduling, refused):
    """Speculative decoding under asynchronous scheduling: the scheduler reports positions that assume every draft
    accepted (the runner corrects them on the device), so no request may capture its generated tokens; the workers and
    the connector refuse it by the one rule, whatever its max_tokens, and prompt-only requests are untouched."""
    from hscapture.adapters.requested import outputs_refused

    spec = None if drafts is None else SimpleNamespace(num_speculative_tokens=drafts, method="eagle3")
    vc = SimpleNamespace(speculative_config=spec, scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))
    why = outputs_refused(vc)
    assert (why is not None) == refused
    if not refused:
        return
    assert "--no-async-scheduling" in why and "eagle3, 3 draft tokens" in why
    out = _native.Output.described({"kind": "staging", "root": "/s", "format": "file"}, outputs_refused=why)
    for max_tokens in (None, 1, 10**6):
        got = out.growing_refusal(3, 128, "float32", "r7", 10, max_tokens)
        assert got is not None and got.startswith('request "r7" refused at admission: its generated tokens')
