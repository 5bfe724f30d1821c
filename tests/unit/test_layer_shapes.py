"""What a hooked layer may hand the capture: [tokens, hidden] rows, or a batch of one ([1, tokens, hidden], vLLM's
Transformers modeling backend). A layer that returns several hidden states per token ([streams, tokens, hidden],
Gemma 3n's AltUp) is refused by its shape, never flattened into more rows and read from its first stream; outside a
step (vLLM's profile and warm-up forwards) at once, so that such a model stops vLLM's start-up."""

from __future__ import annotations

import pytest
import torch
from test_rpc import Worker
from test_session import H, rows_tagged

from hscapture import ShapeContractError
from support import new_req, sched


def step(w: Worker, shape_of) -> list:
    so = sched(new=[new_req("a", [5, 6, 7, 8, 9], 0)], n={"a": 5})
    cap = w._hscapture
    w.runner.lay_out(["a"])
    cap.begin(so)
    for slot in range(len(cap.layer_ids)):
        cap.on_capture(slot, shape_of(rows_tagged(slot, 5)), None)
    cap.end()
    cap.flush()
    return [d["data"] for d in cap.session.take_samples()]


def test_a_batch_of_one_is_read_as_its_rows():
    assert step(Worker(), lambda h: h.unsqueeze(0)) == step(Worker(), lambda h: h)


def test_several_streams_per_token_are_refused_at_the_steps_end():
    w = Worker()
    with pytest.raises(ShapeContractError, match=r"found shape \[4, 5, 8\]; this layer returns several hidden states"):
        step(w, lambda h: torch.stack([h] * 4))


def test_outside_a_step_the_shape_is_checked_at_once():
    cap = Worker()._hscapture
    cap.on_capture(0, torch.zeros(1, 7, H), torch.zeros(1, 7, H))  # a profile forward of 7 tokens, a batch of one
    cap.on_capture(1, torch.zeros(7, H), None)
    with pytest.raises(ShapeContractError, match=r"layer id 3 .*found shape \[4, 7, 8\]"):
        Worker()._hscapture.on_capture(1, torch.zeros(4, 7, H), None)
    with pytest.raises(ShapeContractError, match=r"expected hidden size 8"):
        Worker()._hscapture.on_capture(0, torch.zeros(7, H + 1), None)
