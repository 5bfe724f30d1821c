"""A residual stream sharded across TP ranks (vLLM's sequence-parallel MoE, 0.26+): each rank holds a
contiguous chunk of ceil(n/tp) rows; hscapture gathers the chunks in rank order before capture, so the
samples equal those of a replicated stream. Shapes that are neither are refused, naming layer and rank."""

from __future__ import annotations

import pytest
import torch
from test_rpc import Worker
from test_session import rows_tagged

from hscapture import ShapeContractError, _native
from support import new_req, sched


class ShardedTP:
    """Rank `rank` of `size`: `shard` splits a full tensor the way vLLM does (pad to a multiple of the TP
    size, contiguous chunks); `gather_rows` returns the padded whole, as an all-gather in rank order would."""

    def __init__(self, size, rank):
        self.size, self.rank = size, rank
        self.whole: dict[int, torch.Tensor] = {}
        self.gathers = 0

    def shard(self, t):
        chunk = -(-t.shape[0] // self.size)
        padded = torch.cat([t, t.new_zeros(chunk * self.size - t.shape[0], *t.shape[1:])])
        mine = padded[self.rank * chunk : (self.rank + 1) * chunk]
        self.whole[id(mine)] = padded
        return mine

    def gather_rows(self, t):
        self.gathers += 1
        return self.whole[id(t)]

    def all_gather_i64(self, v):
        return [v] * self.size

    def all_gather_i64s(self, v):
        return [v] * self.size


def run(tp, so, order, sharded):
    w = Worker()
    cap = w._hscapture
    if tp is not None:
        cap.sync.tp = tp
    w.runner.lay_out(order)
    cap.begin(so)
    for slot in range(len(cap.layer_ids)):
        h = rows_tagged(slot, so.total_num_scheduled_tokens)
        r = torch.full_like(h, 0.25)
        if sharded:
            cap.on_capture(slot, tp.shard(h), tp.shard(r))
        else:
            cap.on_capture(slot, h, r)
    cap.end()
    return {d["request_id"]: d["data"] for d in cap.session.take_samples()}


@pytest.mark.parametrize("size,rank", [(2, 0), (2, 1), (4, 3)])
def test_gathered_shards_equal_the_replicated_stream(size, rank):
    so = sched(new=[new_req("a", [1, 2, 3], 0), new_req("b", [4, 5, 6, 7, 8, 9, 10], 1)], n={"a": 3, "b": 7})
    tp = ShardedTP(size, rank)
    got = run(tp, so, ["b", "a"], sharded=True)
    want = run(None, so, ["b", "a"], sharded=False)
    assert tp.gathers == 2 * 2  # hidden and residual, for each of the two layer slots
    assert got == want and set(got) == {"a", "b"}


def test_an_unknown_layout_is_refused_naming_layer_rank_and_shapes():
    so = sched(new=[new_req("a", list(range(1, 11)), 0)], n={"a": 10})
    w = Worker()
    w._hscapture.sync.tp = ShardedTP(4, 1)
    w.runner.lay_out(["a"])
    w._hscapture.begin(so)
    h = torch.zeros(4, 8)
    w._hscapture.on_capture(0, h, h)  # a hook keeps its error for the step's end, where the ranks meet
    with pytest.raises(
        ShapeContractError, match=r"layer id 1 \(after convention, slot 0\), tensor-parallel rank 1 of 4: 4 rows"
    ):
        w._hscapture.end()


def test_the_layout_rule():
    assert _native.row_layout(10, 10, 10, 2, 0, "l") is None
    assert _native.row_layout(3, 10, 10, 4, 0, "l") == 3
    with pytest.raises(ShapeContractError):
        _native.row_layout(2, 10, 10, 4, 0, "l")
