"""The speculators-compatible RPC surface, without an engine: real Rust session, vLLM-shaped steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_session import H, new_req, rows_tagged, sched

from hscapture import AttributionError, ConfigError, ShapeContractError, _native
from hscapture.capture import WorkerCapture
from hscapture.config import CaptureConfig
from hscapture.rpc import HiddenStatesRPC


class Runner:
    def __init__(self):
        self.input_batch = SimpleNamespace(num_reqs=0, req_ids=[])

    def lay_out(self, order):
        self.input_batch.num_reqs, self.input_batch.req_ids = len(order), list(order)


class Worker(HiddenStatesRPC):
    """What vLLM's worker is to the extension: an object with the RPC methods and a capture."""

    def __init__(self, layers=(1, 3)):
        self.runner = Runner()
        cap = object.__new__(WorkerCapture)
        session = _native.CaptureSession(list(layers), "after", 4, H, "float32", "float32", assemble=True)
        cap._init_state(CaptureConfig(layers=tuple(layers), convention="after"), session,
                        SimpleNamespace(size=1, rank=0), self.runner, 0)
        self._hscapture = cap

    def step(self, so, order, values=rows_tagged):
        cap = self._hscapture
        self.runner.lay_out(order)
        cap.begin(so)
        for slot in range(len(cap.layer_ids)):
            h = values(slot, so.total_num_scheduled_tokens)
            cap._on_capture(slot, h, torch.zeros_like(h))
        cap.end()


class SplitTP:
    """Two TP ranks whose checksums differ: what the all-gathers return when rank 1 diverged (both ranks
    healthy, the same number of steps, different digests and checksums)."""

    size, rank = 2, 0

    def all_gather_i64s(self, v):
        failed, n, digest = v
        return [v, [failed, n, digest + 1 if n else digest]]

    def all_gather_i64(self, v):
        return [v, v + 1]


class PeerFailedTP:
    """Rank 0's view when rank 1's capture failed on its own (say its device raised) and rank 1 still
    meets the others, saying so."""

    size, rank = 2, 0

    def __init__(self):
        self.met = []

    def all_gather_i64s(self, v):
        self.met.append(v[0])
        return [v, [1, 0, 0]]

    def all_gather_i64(self, v):
        raise AssertionError("no checksum is compared with a rank that failed")


def test_a_rank_mismatch_leaves_no_step_half_begun():
    from hscapture import RankMismatchError

    w = Worker()
    w._hscapture.tp = SplitTP()
    with pytest.raises(RankMismatchError, match=r"ranks \[1\] disagree"):
        w.step(sched(new=[new_req("a", [1, 2, 3], None)], n={"a": 3}), ["a"])
    assert not w._hscapture.session.in_step


def test_after_a_failed_step_every_later_step_and_result_is_refused():
    """vLLM 0.23's batch queue went on scheduling steps after a worker raised (seen on two H200s); the
    capture must not go on, nor hand a driver a result with a gap."""
    from hscapture import RankMismatchError

    w = Worker()
    cap = w._hscapture
    cap.tp = SplitTP()
    with pytest.raises(RankMismatchError, match=r"ranks \[1\] disagree"):
        w.step(sched(new=[new_req("a", [1, 2, 3], None)], n={"a": 3}), ["a"])
    cap.tp = SimpleNamespace(size=1, rank=0)  # the ranks would agree now: the gap stays
    for call in (lambda: w.step(sched(new=[new_req("b", [4, 5], None)], n={"b": 2}), ["b"]), cap.flush, cap.drain,
                 w._get_captured_states):
        with pytest.raises(RankMismatchError, match=r"refused: an earlier step failed on this rank .*ranks \[1\] disagree"):
            call()
    assert not cap.session.in_step
    cap.close()  # releases without raising the reported failure again


def test_a_rank_whose_peer_failed_stops_at_the_next_meeting_instead_of_waiting():
    from hscapture import HscaptureError, RankMismatchError

    w = Worker()
    cap = w._hscapture
    cap.tp = tp = PeerFailedTP()
    with pytest.raises(HscaptureError, match=r"a new step refused: tensor-parallel rank\(s\) \[1\] failed") as ei:
        w.step(sched(new=[new_req("a", [1, 2, 3], None)], n={"a": 3}), ["a"])
    assert not isinstance(ei.value, RankMismatchError) and tp.met == [0], "it met the others once, healthy"
    assert not cap.session.in_step
    with pytest.raises(HscaptureError, match=r"refused: tensor-parallel rank\(s\) \[1\] failed at an earlier step"):
        cap.drain()
    assert tp.met == [0, 1], "and at the next meeting it says it stopped"
    cap.close()  # meets once more, and releases without raising: the failure was reported
    assert tp.met == [0, 1, 1]


class CountingTP:
    """Two ranks; counts this rank's meetings; the peer is healthy and accounts what this rank does."""

    size, rank = 2, 0

    def __init__(self):
        self.met = 0

    def all_gather_i64s(self, v):
        self.met += 1
        return [v, [0, v[1], v[2]]]

    def all_gather_i64(self, v):
        return [v, v]


def test_every_rank_meets_exactly_once_per_call_whatever_fails():
    """The count of all-gathers must not depend on what failed where, or ranks wait for each other."""
    from hscapture import ShapeContractError

    w = Worker()
    cap = w._hscapture
    cap.tp = tp = CountingTP()
    w.step(sched(new=[new_req("a", [1, 2, 3], None)], n={"a": 3}), ["a"])
    assert tp.met == 2, "a step: its begin and its end"
    cap.begin(sched(new=[new_req("b", [4, 5], None)], n={"b": 2}))
    w.runner.lay_out(["b"])
    cap._on_capture(0, rows_tagged(0, 2), torch.zeros(2, H))
    with pytest.raises(ShapeContractError, match="never reached its hook"):
        cap.end()  # slot 1 missing: this rank fails in its own end, and still meets the others there
    assert tp.met == 4
    cap.abandon(RuntimeError("vLLM's forward raised"))  # a later forward that raised: met as an end
    assert tp.met == 5
    for call in (cap.flush, cap.drain):
        with pytest.raises(ShapeContractError, match="refused: an earlier step failed on this rank"):
            call()
    assert tp.met == 7
    cap.abandon(KeyboardInterrupt())  # the process is going down: no meeting
    assert tp.met == 7


def test_a_forward_that_raised_stops_the_capture():
    from hscapture import HscaptureError

    w = Worker()
    cap = w._hscapture
    cap.begin(sched(new=[new_req("a", [1, 2, 3], None)], n={"a": 3}))
    cap.abandon(RuntimeError("CUDA out of memory"))
    with pytest.raises(HscaptureError, match=r"refused: .*the forward of a step raised RuntimeError: CUDA out of memory"):
        cap.begin(sched(cached=[], new=[new_req("b", [4, 5], None)], n={"b": 2}))


def test_before_setup_every_call_is_a_typed_error():
    w = HiddenStatesRPC()
    for call in (w._reset_capture, w._get_captured_states, lambda: w._set_request_metadata({}),
                 lambda: w._store_captured_states([])):
        with pytest.raises(ConfigError, match="_setup_hidden_states_capture"):
            call()


def two_steps(w, metadata: bool):
    """a (3 tokens) whole and b's first 2 of 5; then b's last 3 next to a decode token."""
    w._reset_capture()
    if metadata:
        w._set_request_metadata({"a": 3, "b": 2})
    w.step(sched(new=[new_req("a", [1, 2, 3], None), new_req("b", [4, 5, 6, 7, 8], None)], n={"a": 3, "b": 2}), ["b", "a"])
    if metadata:
        w._set_request_metadata({"b": 3})
    w.step(sched(cached=[("a", 3), ("b", 2)], n={"a": 1, "b": 3}), ["a", "b"])


def test_metadata_drivers_get_a_dict_of_per_layer_tensors():
    w = Worker()
    two_steps(w, metadata=True)
    got = w._get_captured_states()
    assert sorted(got) == ["a", "b"]
    assert [t.shape for t in got["b"]] == [(5, H), (5, H)]
    # b's rows: step-1 rows 0..1, then step-2 rows 1..3 (row 0 was a's decode token)
    assert got["b"][0][:, 0].tolist() == [0.0, 1.0, 1.0, 2.0, 3.0]
    assert got["b"][1][:, 0].tolist() == [100.0, 101.0, 101.0, 102.0, 103.0]
    assert w._get_captured_states() is None, "collected samples are handed out once"


def test_drivers_without_metadata_get_one_tensor_per_layer_in_admission_order():
    w = Worker()
    two_steps(w, metadata=False)
    got = w._get_captured_states()
    assert isinstance(got, list) and [t.shape for t in got] == [(8, H), (8, H)]
    # a (admitted first) then b, each whole — though b's rows came first in step 1.
    assert got[0][:, 0].tolist() == [2.0, 3.0, 4.0, 0.0, 1.0, 1.0, 2.0, 3.0]


def test_metadata_that_disagrees_with_the_scheduler_is_refused():
    w = Worker()
    w._reset_capture()
    w._set_request_metadata({"a": 2})  # the driver thinks a contributes 2 tokens; the scheduler says 3
    with pytest.raises(AttributionError, match=r"a: hscapture 3, driver 2"):
        w.step(sched(new=[new_req("a", [1, 2, 3], None)], n={"a": 3}), ["a"])


def test_an_incomplete_request_is_refused_in_the_list_shape():
    w = Worker()
    w._reset_capture()
    w.step(sched(new=[new_req("a", [1, 2, 3], None), new_req("b", [4, 5, 6, 7], None)], n={"a": 3, "b": 2}), ["a", "b"])
    with pytest.raises(AttributionError, match=r"no complete states .*\['b'\]"):
        w._get_captured_states()


def test_store_captured_states_goes_through_the_contract():
    w = Worker()
    cap = w._hscapture
    with pytest.raises(AttributionError, match="outside a step"):
        w._store_captured_states([torch.zeros(3, H), torch.zeros(3, H)])
    w.runner.lay_out(["a"])
    cap.begin(sched(new=[new_req("a", [1, 2, 3], None)], n={"a": 3}))
    with pytest.raises(ShapeContractError, match="expected 2 tensors"):
        w._store_captured_states([torch.zeros(3, H)])
    w._store_captured_states([torch.ones(3, H), 2 * torch.ones(3, H)])
    cap.end()
    got = w._get_captured_states()
    assert got[1].tolist() == (2 * torch.ones(3, H)).tolist()
