"""What speculators' drivers add to a capture (``RpcState``): their view of each step, the order requests were
admitted in, and the shape of ``_get_captured_states``' answer. The RPC methods themselves are ``rpc.py``'s."""

from __future__ import annotations

from typing import Any

from ..errors import AttributionError, ShapeContractError


def _split_layers(d: dict) -> list:
    """A sample from ``take_samples`` as one ``[L, H]`` tensor per layer."""
    import torch

    t = torch.frombuffer(bytearray(d["data"]), dtype=getattr(torch, d["dtype"])).reshape(d["shape"])
    return [t[:, k, :].clone() for k in range(t.shape[1])]


class RpcState:
    """What speculators' drivers add to a capture: their own view of each step (``expect_rows``, checked
    against hscapture's attribution at the step's end), the order the scheduler admitted requests in (0.3's
    driver slices the concatenated states back in that order), and the shape of the answer."""

    def __init__(self, cap: Any) -> None:
        import weakref

        from ..adapters.requested import destination

        # Weakly: the capture owns this state, and a cycle between them would outlive its close in a vLLM engine,
        # which freezes its start-up heap out of the collector's reach (gc.freeze): only reference counts free it.
        self.cap = weakref.proxy(cap)
        self.expected: dict[str, int] | None = None
        self.metadata_seen = False
        # Only a capture that keeps its samples for a driver has anything to hand out in admission order; a server's
        # (files, a store) would keep every request id it ever admitted, for as long as it runs.
        self.keeps_order = destination(cap.cfg)["kind"] == "memory"
        self.admitted: list[str] = []
        self._admitted_set: set[str] = set()

    def admit(self, scheduler_output: Any) -> None:
        if not self.keeps_order:
            return
        for r in scheduler_output.scheduled_new_reqs:
            if r.req_id not in self._admitted_set:
                self._admitted_set.add(r.req_id)
                self.admitted.append(r.req_id)

    def expect_rows(self, metadata: dict) -> None:
        self.expected = dict(metadata)
        self.metadata_seen = True

    def check_step(self, session: Any) -> None:
        """At the step's end: the driver's metadata (if it sent any) must name the rows hscapture attributed."""
        expected, self.expected = self.expected, None
        if expected is None:
            return
        ours = dict(session.step_rows())
        theirs = {str(k): int(v) for k, v in expected.items() if int(v) > 0}
        if ours != theirs:
            diff = sorted(set(ours) | set(theirs))
            lines = [
                f"{r}: hscapture {ours.get(r, 0)}, driver {theirs.get(r, 0)}"
                for r in diff
                if ours.get(r, 0) != theirs.get(r, 0)
            ]
            if session.in_step:
                session.abandon_step()
            raise AttributionError(
                "the driver's request metadata disagrees with the scheduler output about which prompt tokens this step "
                f"holds ({'; '.join(lines[:8])}); the driver's own bookkeeping has drifted (preemption? chunked prefill?) "
                "— hscapture attributes by the scheduler output, which is what the model ran"
            )

    def reset(self) -> None:
        self.cap.session.take_samples()
        self.cap.session.take_aborted()
        self.expected, self.metadata_seen = None, False
        self.admitted, self._admitted_set = [], set()

    def store(self, aux_hidden_states: list) -> None:
        cap = self.cap
        if not cap._active:
            raise AttributionError(
                "_store_captured_states was called outside a step; states belong to the step that computed them"
            )
        if len(aux_hidden_states) != len(cap.layer_ids):
            raise ShapeContractError(
                f"_store_captured_states: expected {len(cap.layer_ids)} tensors (layers {cap.layer_ids}), found {len(aux_hidden_states)}"
            )
        for slot, t in enumerate(aux_hidden_states):
            cap.capture(slot, t, None)

    def collect(self):
        import torch

        cap = self.cap
        cap.flush()
        if not cap.writer_rank:
            return None
        samples = {d["request_id"]: d for d in cap.session.take_samples()}
        if not samples:
            return None
        layers = {rid: _split_layers(d) for rid, d in samples.items()}
        if self.metadata_seen:
            return layers
        missing = [r for r in self.admitted if r not in layers]
        if missing:
            raise AttributionError(
                f"{len(missing)} admitted requests have no complete states (first: {missing[:5]}): the driver finished "
                "them before their prefill was done (a request split across steps by chunked prefill and aborted after "
                "its first chunk?); raise max_num_batched_tokens above the longest prompt"
            )
        order = [r for r in self.admitted if r in layers]
        return [torch.cat([layers[r][k] for r in order], dim=0) for k in range(len(cap.layer_ids))]
