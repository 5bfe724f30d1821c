"""Failures and the TP ranks' meetings (``ranksync.py``), without an engine: two real Rust sessions in two
threads, meeting through an all-gather built on a barrier. What must hold whatever fails where: both
ranks make the same all-gathers (a missing one would leave the other waiting: the barrier's timeout
turns that into a failed test), both stop, and only the failed rank's own error is recorded."""

from __future__ import annotations

import threading

import pytest
import torch
from test_rpc import Worker
from test_session import H, rows_tagged

from hscapture import HscaptureError, OutputError, RankMismatchError, ShapeContractError
from hscapture.output import failures
from support import new_req, sched


class Exchange:
    """An all-gather among threads (one per rank)."""

    def __init__(self, size: int):
        self.size, self.slots = size, [None] * size
        self.barrier = threading.Barrier(size, timeout=20)

    def gather(self, rank, value):
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # all have read before the next round writes
        return out


class ThreadTP:
    def __init__(self, ex: Exchange, rank: int):
        self.ex, self.size, self.rank, self.log = ex, ex.size, rank, []

    def all_gather_i64s(self, v):
        self.log.append("meet")
        return self.ex.gather(self.rank, list(v))

    def all_gather_i64(self, v):
        self.log.append("checksum")
        return self.ex.gather(self.rank, v)

    def start_all_gather_i64s(self, v):
        self.log.append("meet")
        got = []
        t = threading.Thread(target=lambda: got.append(self.ex.gather(self.rank, list(v))))
        t.start()

        def finish():
            t.join(30)
            return got[0]

        return finish


class FailingSession:
    """A session whose named call fails once with OutputError (say the writer's disk filled up)."""

    def __init__(self, inner, fail: str):
        self.inner, self.fail = inner, fail

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name != self.fail:
            return attr

        def failing(*a, **k):
            self.fail = None
            attr(*a, **k)
            raise OutputError("writing hs_0.safetensors: No space left on device; free space and re-run")

        return failing


def two_ranks(tmp_path, setup, script):
    """Runs ``script(worker, rank)`` on two ranks at once; returns per rank (worker, outcome list, error)."""
    ex = Exchange(2)
    ws = []
    for rank in range(2):
        w = Worker(tp=ThreadTP(ex, rank), rank=rank, out=str(tmp_path))
        setup(w, rank)
        ws.append(w)
    results = [None, None]

    def run(rank):
        got = []
        try:
            script(ws[rank], rank, got)
        except threading.BrokenBarrierError as e:  # a rank waited for the other: the property is broken
            got.append(("HANG", str(e)))
        results[rank] = got

    ts = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return ws, results


def call(got, name, fn):
    try:
        fn()
        got.append((name, "ok"))
    except HscaptureError as e:
        got.append((name, type(e).__name__, str(e)))


def steps(w, rank, got, hook_error_on=None, forward_error_on=None):
    """Three steps a vLLM engine that goes on after errors would run, then the driver's calls."""
    cap = w._hscapture
    for k, (rid, n) in enumerate((("a", 3), ("b", 4), ("c", 2))):
        so = sched(new=[new_req(rid, list(range(1, n + 1)), k)], n={rid: n})
        try:
            cap.begin(so)
        except HscaptureError as e:
            got.append((f"begin {rid}", type(e).__name__, str(e)))
            continue
        w.runner.lay_out([rid])
        if forward_error_on == (rank, rid):  # vLLM's forward raised on this rank alone, after its collectives
            cap.abandon(RuntimeError("CUDA error: an illegal memory access was encountered"))
            got.append((f"forward {rid}", "raised"))
            continue
        for slot in range(len(cap.layer_ids)):
            h = rows_tagged(slot, n)
            if hook_error_on == (rank, rid) and slot == 0:
                h = h[:, :-1]  # a tensor of the wrong width: the hook keeps the error for the step's end
            cap.on_capture(slot, h, torch.zeros_like(h))
        call(got, f"end {rid}", cap.end)
    call(got, "drain", cap.drain)
    call(got, "close", cap.close)


def test_two_healthy_ranks_meet_alike_and_capture(tmp_path):
    ws, res = two_ranks(tmp_path, lambda w, r: None, steps)
    assert res[0] == res[1] == [("end a", "ok"), ("end b", "ok"), ("end c", "ok"), ("drain", "ok"), ("close", "ok")]
    assert (
        ws[0]._hscapture.sync.tp.log == ws[1]._hscapture.sync.tp.log == ["meet"] * 8
    )  # 3 × (begin, end), drain, close


@pytest.mark.parametrize("rank", [0, 1])
def test_a_hook_error_on_one_rank_stops_both_at_the_step_end(tmp_path, rank):
    ws, res = two_ranks(tmp_path, lambda w, r: None, lambda w, r, got: steps(w, r, got, hook_error_on=(rank, "b")))
    mine, other = res[rank], res[1 - rank]
    assert not [x for x in mine + other if x[0] == "HANG"], res
    assert ws[0]._hscapture.sync.tp.log == ws[1]._hscapture.sync.tp.log, "the same all-gathers on both ranks"
    assert mine[1][:2] == ("end b", "ShapeContractError") and "refused" not in mine[1][2], "the hook's own error"
    assert mine[2][:2] == ("begin c", "ShapeContractError") and "refused: this rank" in mine[2][2]
    assert (
        other[1][:2] == ("end b", "PeerFailedError")
        and f"tensor-parallel rank {rank} (global rank {rank}) failed" in other[1][2]
    )
    assert [x[0] for x in mine[2:]] == [x[0] for x in other[2:]] == ["begin c", "drain", "close"]
    assert mine[-1] == other[-1] == ("close", "ok"), "close never raises: both ranks go on alike"
    with pytest.raises(ShapeContractError, match=rf"raised by the worker of rank {rank}\]"):
        failures.raise_recorded(tmp_path)  # only the failed rank's own error was recorded


@pytest.mark.parametrize("rank", [0, 1])
def test_a_forward_that_raised_on_one_rank_stops_both_without_a_hang(tmp_path, rank):
    ws, res = two_ranks(tmp_path, lambda w, r: None, lambda w, r, got: steps(w, r, got, forward_error_on=(rank, "b")))
    mine, other = res[rank], res[1 - rank]
    assert not [x for x in mine + other if x[0] == "HANG"], res
    assert ws[0]._hscapture.sync.tp.log == ws[1]._hscapture.sync.tp.log == ["meet"] * 7, (
        "a, b: begin and end; c: begin; drain; close"
    )
    assert mine[1] == ("forward b", "raised")
    assert mine[2][:2] == ("begin c", "HscaptureError") and mine[2][2].startswith(
        "the forward of a step raised RuntimeError"
    )
    assert (
        other[1][:2] == ("end b", "PeerFailedError")
        and f"tensor-parallel rank {rank} (global rank {rank}) failed" in other[1][2]
    )
    assert mine[-1] == other[-1] == ("close", "ok")
    with pytest.raises(HscaptureError, match=rf"illegal memory access.*raised by the worker of rank {rank}\]"):
        failures.raise_recorded(tmp_path)


def test_a_writer_failure_on_rank_0_alone_stops_both_without_a_hang(tmp_path):
    def setup(w, rank):
        if rank == 0:  # the writing rank: its session call fails after accounting the step
            w._hscapture.session = FailingSession(w._hscapture.session, "end_step")

    ws, res = two_ranks(tmp_path, setup, steps)
    assert not [x for x in res[0] + res[1] if x[0] == "HANG"], res
    assert ws[0]._hscapture.sync.tp.log == ws[1]._hscapture.sync.tp.log
    assert res[0][0][:2] == ("end a", "OutputError") and "No space left" in res[0][0][2]
    assert (
        res[1][0][:2] == ("end a", "PeerFailedError")
        and "tensor-parallel rank 0 (global rank 0) failed" in res[1][0][2]
    )
    with pytest.raises(OutputError, match="No space left"):
        failures.raise_recorded(tmp_path)


def test_a_divergent_rank_is_named_on_both(tmp_path):
    def setup(w, rank):
        if rank == 1:
            w._hscapture.capture = _perturbed(w._hscapture.capture)

    ws, res = two_ranks(tmp_path, setup, steps)
    assert ws[0]._hscapture.sync.tp.log == ws[1]._hscapture.sync.tp.log
    assert ws[0]._hscapture.sync.tp.log[:3] == ["meet", "meet", "checksum"], "digests differ: then the step's checksum"
    for got in res:
        assert got[0][:2] == ("end a", "RankMismatchError") and "ranks [1] disagree with rank 0" in got[0][2]
        assert [x[:2] for x in got[1:]] == [
            ("begin b", "RankMismatchError"),
            ("begin c", "RankMismatchError"),
            ("drain", "RankMismatchError"),
            ("close", "ok"),
        ]


def _perturbed(capture):
    def f(slot, hidden, residual):
        hidden = hidden.clone()
        hidden[0, 0] += 1.0
        capture(slot, hidden, residual)

    return f


def test_after_a_failed_step_every_later_step_and_result_is_refused():
    """vLLM 0.23's batch queue went on scheduling steps after a worker raised (seen on two H200s); the
    capture must not go on, nor hand a driver a result with a gap."""
    w = Worker()
    cap = w._hscapture
    w.step(sched(new=[new_req("a", [1, 2, 3], None)], n={"a": 3}), ["a"])
    cap.begin(sched(new=[new_req("b", [4, 5], None)], n={"b": 2}))
    w.runner.lay_out(["b"])
    cap.on_capture(0, rows_tagged(0, 2), torch.zeros(2, H))
    with pytest.raises(ShapeContractError, match="never reached its hook"):
        cap.end()  # slot 1 missing
    assert not cap.session.in_step
    for fn in (
        lambda: w.step(sched(new=[new_req("c", [6, 7], None)], n={"c": 2}), ["c"]),
        cap.flush,
        cap.drain,
        w._get_captured_states,
    ):
        with pytest.raises(
            ShapeContractError, match=r"refused: this rank \(rank 0\) failed earlier.*never reached its hook"
        ):
            fn()
    cap.close()  # releases without raising


def test_a_forward_that_raised_stops_the_capture():
    w = Worker()
    cap = w._hscapture
    cap.begin(sched(new=[new_req("a", [1, 2, 3], None)], n={"a": 3}))
    cap.abandon(RuntimeError("CUDA out of memory"))
    assert not cap.session.in_step
    with pytest.raises(HscaptureError, match=r"^the forward of a step raised RuntimeError: CUDA out of memory"):
        cap.begin(sched(new=[new_req("b", [4, 5], None)], n={"b": 2}))  # at the next meeting, as itself
    with pytest.raises(HscaptureError, match=r"refused: this rank \(rank 0\) failed earlier.*CUDA out of memory"):
        cap.flush()  # and refused from then on
    w2 = Worker()
    w2._hscapture.begin(sched(new=[new_req("a", [1, 2, 3], None)], n={"a": 3}))
    w2._hscapture.abandon(KeyboardInterrupt())  # the process is going down: nothing recorded, no refusal kept
    assert w2._hscapture.sync.failure is None


def test_a_rank_mismatch_leaves_no_step_half_begun():
    class SplitTP:  # what rank 0 sees when rank 1 diverged: the digests and then the checksums differ
        size, rank = 2, 0

        def all_gather_i64s(self, v):
            return [v, [v[0], v[1], v[2] + 1 if v[1] else v[2], 1]]

        def all_gather_i64(self, v):
            return [v, v + 1]

    w = Worker(tp=SplitTP())
    with pytest.raises(RankMismatchError, match=r"ranks \[1\] disagree"):
        w.step(sched(new=[new_req("a", [1, 2, 3], None)], n={"a": 3}), ["a"])
    assert not w._hscapture.session.in_step


def _gloo_rank(rank: int, path: str, q) -> None:
    import torch.distributed as dist

    from hscapture.adapters.vllm_compat import TPGroup

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    tp = object.__new__(TPGroup)
    tp.size, tp.rank, tp._cpu_group = 2, rank, dist.group.WORLD
    if rank == 0:  # an abandoned step's meeting, started; then the next meeting
        pending = tp.start_all_gather_i64s([1, 0, 0, 0])
        second = tp.all_gather_i64s([2, 0, 0, 0])
        first = pending()
    else:
        first = tp.all_gather_i64s([10, 0, 0, 1])
        second = tp.all_gather_i64s([20, 0, 0, 1])
    q.put((rank, first, second))
    dist.destroy_process_group()


def test_a_started_meeting_pairs_in_issue_order_over_gloo(tmp_path):
    """What ``abandon`` relies on: a meeting started without waiting pairs with the others' next one."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_gloo_rank, args=(r, str(tmp_path / "store"), q)) for r in range(2)]
    for p in ps:
        p.start()
    got = sorted(q.get(timeout=60) for _ in ps)
    for p in ps:
        p.join(30)
    for _rank, first, second in got:
        assert [r[0] for r in first] == [1, 10] and [r[0] for r in second] == [2, 20]
