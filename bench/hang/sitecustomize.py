"""Where a run that does not finish is stuck (diagnosis only): put this folder first on PYTHONPATH and set
HSHANG_DIR=DIR; every Python process then writes all its threads' stacks to DIR/<pid>.txt every HSHANG_S seconds
(default 30), appending, through faulthandler (which works while the process is blocked in C)."""

import faulthandler
import os
import sys

_DIR = os.environ.get("HSHANG_DIR")
if _DIR:
    try:
        os.makedirs(_DIR, exist_ok=True)
        _f = open(os.path.join(_DIR, f"{os.getpid()}.txt"), "a", buffering=1)  # noqa: SIM115 - lives with the process
        _f.write(f"pid {os.getpid()} argv {getattr(sys, 'argv', [])[:4]}\n")
        faulthandler.dump_traceback_later(float(os.environ.get("HSHANG_S", "30")), repeat=True, file=_f)
    except OSError:
        pass
