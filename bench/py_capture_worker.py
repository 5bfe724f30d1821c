"""The reference path for the GPU benchmark: capture as speculators-style Python code does it —
clone each layer's hidden + residual on the device, after the step cat, slice per request, `.cpu()`
per request, `torch.save` in the worker. Benchmark-only; not part of hscapture.

Config: HSBENCH_LAYERS="2,16,29,31" (after convention), HSBENCH_OUT=/dir.
"""

import os

import torch

from hscapture.adapters import vllm_compat

_Base = vllm_compat.resolve_qualname(vllm_compat.platform_worker_qualname())


class PyCaptureWorker(_Base):
    def load_model(self, *a, **k):
        super().load_model(*a, **k)
        self._ids = [int(x) for x in os.environ["HSBENCH_LAYERS"].split(",")]
        self._out = os.environ["HSBENCH_OUT"]
        os.makedirs(self._out, exist_ok=True)
        self._grab: dict[int, list] = {}
        self._on = False
        layers = self.get_model().model.layers
        for i in self._ids:
            layers[i].register_forward_hook(self._hook(i))
        self._n = 0

    def _hook(self, i):
        def f(_m, _a, out):
            if self._on:
                h, r = out
                self._grab.setdefault(i, []).append((h + r).clone())

        return f

    def execute_model(self, so, *a, **k):
        self._grab = {}
        self._on = True
        try:
            out = super().execute_model(so, *a, **k)
        finally:
            self._on = False
        if self._grab:
            order = vllm_compat.runner_order(self.model_runner)
            cat = [torch.cat(self._grab[i], 0) for i in self._ids]
            off = 0
            for rid in order:
                n = so.num_scheduled_tokens[rid]
                states = [c[off : off + n].cpu() for c in cat]
                off += n
                torch.save({"hidden_states": states}, os.path.join(self._out, f"{rid}-{self._n}.pt"))
            self._n += 1
        return out
