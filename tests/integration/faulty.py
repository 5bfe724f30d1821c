"""Deliberately wrong workers, used to prove the oracle comparison catches attribution and layer errors.
Test-only; imported by vLLM's worker processes through PYTHONPATH (see conftest.py)."""

from hscapture.capture import WorkerCapture
from hscapture.worker import CaptureWorker


class _RotatedOrder(WorkerCapture):
    def step_order(self):
        order = super().step_order()
        return order[1:] + order[:1]  # a wrong token plan: requests' rows attributed to their neighbours


class _ShiftedLayers(WorkerCapture):
    def capture_points(self):
        return [(kind, k + 1 if kind == "layer_output" else k) for kind, k in super().capture_points()]


class RotatedOrderWorker(CaptureWorker):
    capture_cls = _RotatedOrder


class ShiftedLayersWorker(CaptureWorker):
    capture_cls = _ShiftedLayers


class _PerturbedRank1(WorkerCapture):
    def _capture(self, slot, hidden, residual):
        if self.tp.rank == 1:
            hidden = hidden.clone()
            hidden[0, 0] += 1.0  # one value differs on one rank: the replicated stream is not replicated
        super()._capture(slot, hidden, residual)


class PerturbedRankWorker(CaptureWorker):
    capture_cls = _PerturbedRank1
