"""Pipeline parallelism: every stage captures the layers it owns; the assembling rank (tensor-parallel
rank 0 of the last stage) receives each step's rows from tensor-parallel rank 0 of every earlier stage.

All stages see the same scheduler outputs and plan each step identically (``plan.rs``), so a step's
rows travel as one message per stage and per step, checked against the receiver's own plan. The
messages use a gloo group of hscapture's own (created once by every worker, at start-up), never vLLM's
pipeline group: they cannot interleave with vLLM's intermediate tensors. A stage sends without waiting
(``isend``); it waits for its previous step's message to be taken before sending the next, which bounds
what is in flight to one step per stage. A stage that failed in a step sends its error instead of the rows, so the
last stage fails with it at once rather than waiting in gloo's receive.
"""

from __future__ import annotations

from typing import Any

import torch

from ..adapters import vllm_compat
from ..errors import PeerFailedError

_TAG = 0x4853  # "HS"


class StageLink:
    def __init__(
        self, session: Any, pp_size: int, pp_rank: int, tp_rank: int, local_slots: list[int], n_slots: int
    ) -> None:
        import torch.distributed as dist

        self.session = session
        self.local_slots = local_slots
        self.pp_size, self.pp_rank = pp_size, pp_rank
        # Collective over the whole world: every worker creates it, in the same order.
        self.group = dist.new_group(backend="gloo")
        stage_ranks = vllm_compat.pp_stage_ranks()  # global ranks of this TP position, one per stage
        self.active = tp_rank == 0  # only TP rank 0 of each stage sends or receives
        self.last = stage_ranks[-1]
        self.earlier = stage_ranks[:-1]
        self.receiver = self.active and pp_rank == pp_size - 1
        self.sender = self.active and not self.receiver
        self._inflight: list[Any] = []
        self._keep: list[torch.Tensor] = []
        self._sent = False  # this step's message (rows, none, or a failure) is on its way
        if pp_rank != pp_size - 1 or tp_rank != 0:
            # This rank does not assemble: the other stages' layers never reach it.
            session.set_absent_slots([s for s in range(n_slots) if s not in local_slots])

    def exchange(self, order: Any) -> None:
        """At the end of a step's forward, before the step is closed: send or receive its rows.
        ``order()`` gives the runner's request order, for a stage that must plan on receipt."""
        import torch.distributed as dist

        if self.sender:
            # No hook ran (the runner skipped the forward: nothing scheduled): an empty message says so.
            raw = self.session.export_slots(self.local_slots) if self.session.planned else bytearray()
            self._send(raw)
        elif self.receiver:
            for stage, src in enumerate(self.earlier):
                header = torch.empty(1, dtype=torch.int64)
                dist.recv(header, src, group=self.group, tag=_TAG)
                n = int(header.item())
                if n == 0:
                    continue  # that stage ran no forward for this step
                msg = torch.empty(abs(n) - (n < 0), dtype=torch.uint8)
                if msg.numel():
                    dist.recv(msg, src, group=self.group, tag=_TAG)
                if n < 0:
                    text = msg.numpy().tobytes().decode("utf-8", "replace")
                    e = PeerFailedError(f"pipeline stage {stage} (global rank {src}) failed: {text}")
                    e.peers = f"pipeline stage {stage}"
                    raise e
                if not self.session.planned:
                    self.session.plan(order())  # no captured layer of this stage ran its hook
                self.session.import_slots(msg.numpy().tobytes(), f"pipeline stage {stage} (rank {src})")

    def new_step(self) -> None:
        self._sent = False

    def send_failure(self, error: BaseException) -> None:
        """This stage failed in a step: the last stage, waiting for the step's rows, gets the error instead (a
        negative header: the error's text follows), at most once a step."""
        if self.sender and not self._sent:
            self._send(bytearray(str(error).encode("utf-8")[:4096]), failed=True)

    def _send(self, raw: bytearray, failed: bool = False) -> None:
        import torch.distributed as dist

        self._wait()
        msg = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        header = torch.tensor([-(msg.numel() + 1) if failed else msg.numel()], dtype=torch.int64)
        self._keep = [header, msg]
        self._inflight = [dist.isend(header, self.last, group=self.group, tag=_TAG)]
        if msg.numel():
            self._inflight.append(dist.isend(msg, self.last, group=self.group, tag=_TAG))
        self._sent = True

    def _wait(self) -> None:
        for w in self._inflight:
            w.wait()
        self._inflight, self._keep = [], []

    def close(self) -> None:
        self._wait()
