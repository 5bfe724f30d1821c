"""Deliberately wrong workers, used to prove the oracle comparison catches attribution and layer errors.
Test-only; imported by vLLM's worker processes through PYTHONPATH (see conftest.py)."""

import os
import sys

from hscapture.capture.worker_capture import WorkerCapture
from hscapture.worker import CaptureWorker

_TRACE = os.environ.get("HSCAPTURE_TEST_TRACE") == "1"  # prints what the perturbed rank captured and checked


class _RotatedOrder(WorkerCapture):
    def step_order(self):
        order = super().step_order()
        return order[1:] + order[:1]  # a wrong token plan: requests' rows attributed to their neighbours


class _ShiftedLayers(WorkerCapture):
    @classmethod
    def points_of(cls, session):
        return [(kind, k + 1 if kind == "layer_output" else k) for kind, k in super().points_of(session)]


class RotatedOrderWorker(CaptureWorker):
    capture_cls = _RotatedOrder


class ShiftedLayersWorker(CaptureWorker):
    capture_cls = _ShiftedLayers


class _PerturbedRank1(WorkerCapture):
    def capture(self, slot, hidden, residual):
        if self.tp.rank == 1:
            hidden = hidden.clone()
            hidden[0, 0] += 1.0  # one value differs on one rank: the replicated stream is not replicated
        if _TRACE:
            print(
                f"[trace rank {self.tp.rank}/{self.tp.size}] capture slot {slot} path {self.device_path} "
                f"rows {tuple(hidden.shape)} {hidden.device} h00={float(hidden[0, 0]):.4f}",
                file=sys.stderr,
                flush=True,
            )
        super().capture(slot, hidden, residual)


class PerturbedRankWorker(CaptureWorker):
    capture_cls = _PerturbedRank1


class _NaNInSample1(WorkerCapture):
    """Puts a NaN into the rows of the request carrying sample index 1, in every step it is scheduled."""

    def begin(self, scheduler_output):
        from hscapture.adapters.vllm_compat import sample_index

        super().begin(scheduler_output)
        for r in scheduler_output.scheduled_new_reqs:
            if sample_index(r.sampling_params) == 1:
                self._poisoned = r.req_id

    def capture(self, slot, hidden, residual):
        target = getattr(self, "_poisoned", None)
        order = self.step_order()
        if target in order and self._scheduled.get(target, 0) > 0:
            at = sum(self._scheduled.get(r, 0) for r in order[: order.index(target)])
            hidden = hidden.clone()
            hidden[at, 3] = float("nan")
        super().capture(slot, hidden, residual)


class NaNWorker(CaptureWorker):
    capture_cls = _NaNInSample1


class _Sample3DiffersOnRank1(_NaNInSample1):
    """Rank 1 alone sees one value of sample index 3's rows changed: the ranks disagree first at the step that
    schedules it (under max_num_seqs=1 with a one-step prompt, the step that also completes it)."""

    def begin(self, scheduler_output):
        from hscapture.adapters.vllm_compat import sample_index

        WorkerCapture.begin(self, scheduler_output)
        for r in scheduler_output.scheduled_new_reqs:
            if sample_index(r.sampling_params) == 3:
                self._poisoned = r.req_id

    def capture(self, slot, hidden, residual):
        target = getattr(self, "_poisoned", None)
        order = self.step_order()
        if self.tp.rank == 1 and target in order and self._scheduled.get(target, 0) > 0:
            at = sum(self._scheduled.get(r, 0) for r in order[: order.index(target)])
            hidden = hidden.clone()
            hidden[at, 0] += 1.0
        WorkerCapture.capture(self, slot, hidden, residual)


class Sample3DiffersOnRank1Worker(CaptureWorker):
    capture_cls = _Sample3DiffersOnRank1


MARKER = 1000  # a prompt starting with this token gets a NaN in its rows (NaNInMarkedPromptWorker)


class _NaNInMarkedPrompt(_NaNInSample1):
    """As _NaNInSample1, for the request whose prompt starts with MARKER (a server has no sample indices)."""

    def begin(self, scheduler_output):
        WorkerCapture.begin(self, scheduler_output)
        for r in scheduler_output.scheduled_new_reqs:
            if list(r.prompt_token_ids or [])[:1] == [MARKER]:
                self._poisoned = r.req_id


class NaNInMarkedPromptWorker(CaptureWorker):
    capture_cls = _NaNInMarkedPrompt


class _FailsOnFirstStage(WorkerCapture):
    """Pipeline stage 0 fails in its third step with a forward (a hook's error, as a broken layer would raise)."""

    def capture(self, slot, hidden, residual):
        from hscapture.errors import ShapeContractError

        if self.link is not None and self.link.pp_rank == 0:
            self._seen = getattr(self, "_seen", 0) + (slot == 0)
            if self._seen >= 3:
                raise ShapeContractError("injected on pipeline stage 0: a hook saw a tensor it cannot take")
        super().capture(slot, hidden, residual)


class FailsOnFirstStageWorker(CaptureWorker):
    capture_cls = _FailsOnFirstStage
