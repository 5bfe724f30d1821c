"""Test-only start-up hook, imported by every Python process the integration tests start (this folder is on their
PYTHONPATH, see conftest.py): it memoizes torch inductor's vector-ISA probes per machine.

Why: vLLM on CPU runs a few torch.compile'd helpers even with `enforce_eager`, and on their first call in each
process inductor probes the AVX-512 bf16 and VNNI instruction sets by compiling a test library and starting a
Python that imports torch to load it (torch 2.10, `cpu_vec_isa.VecISA.check_build`). That is ~10 s of the first
step of every engine and every worker, most of a tiny model's test. The probe's answer depends only on the machine,
torch and the probed code, so the first process on a machine runs it and writes the answer to a file; the others
read it. What is probed, and the answer, are unchanged.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.util
import json
import os
import sys

_MODULE = "torch._inductor.cpu_vec_isa"


def _patch(module) -> None:
    probe = module.VecISA.check_build
    root = os.environ.get("HSCAPTURE_TEST_ISA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hscapture", "isa"
    )

    def check_build(self, code: str) -> bool:
        import torch

        key = hashlib.sha256(f"{torch.__version__}\0{self._arch_flags}\0{code}".encode()).hexdigest()[:32]
        path = os.path.join(root, f"{key}.json")
        try:
            with open(path) as f:
                return bool(json.load(f)["ok"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        ok = bool(probe(self, code))
        os.makedirs(root, exist_ok=True)
        part = f"{path}.{os.getpid()}"
        with open(part, "w") as f:
            json.dump({"ok": ok}, f)
        os.replace(part, path)  # whole or absent: a process reading at the same time sees no half answer
        return ok

    module.VecISA.check_build = check_build


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the module as Python would, and patches it once it has run."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Patches the module now if it is loaded, else when it is imported (once either way)."""
    if getattr(sys, "_hscapture_isa_memo", False):
        return
    sys._hscapture_isa_memo = True
    if _MODULE in sys.modules:
        _patch(sys.modules[_MODULE])
    else:
        sys.meta_path.insert(0, _PatchOnImport())


install()
