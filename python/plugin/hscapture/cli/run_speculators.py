"""``hscapture run-speculators -- SCRIPT [ARGS...]``: runs a speculators data-generation script unchanged,
on hscapture: sets ``HSCAPTURE_SPECULATORS=1`` (inherited by every vLLM process, where the plugin swaps
the worker extension), applies the generator module's shims, then runs the script as ``__main__``."""

from __future__ import annotations

import os
import runpy
import sys


def run(script: str, args: list[str], use_hscapture: bool = True) -> None:
    if use_hscapture:
        os.environ["HSCAPTURE_SPECULATORS"] = "1"
    from ..patches import apply_generator_shims
    from ..patches.speculators_driver import GENERATOR

    try:
        import importlib

        mod = importlib.import_module(GENERATOR)
    except ImportError as e:
        from ..errors import CompatibilityError

        raise CompatibilityError(
            f"speculators' generator ({GENERATOR}) cannot be imported: {e}; install speculators"
        ) from e
    applied = apply_generator_shims(mod)
    if use_hscapture:
        from ..plugin import swap_extension

        swap_extension()
    print(
        f"[hscapture] running {script} with speculators on {'hscapture' if use_hscapture else 'its own extension'}"
        f"; shims: {', '.join(applied) or 'none'}",
        file=sys.stderr,
        flush=True,
    )
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
