"""A wall-clock stack sampler for every Python process of a benchmark run (diagnosis only, not a benchmark figure).

Put this folder first on PYTHONPATH and set HSBENCH_PROFILE=DIR: each process waits until DIR/start exists (the
benchmark creates it once the engine is up), then samples every thread's stack every HSBENCH_PROFILE_MS (1 ms) and
rewrites DIR/<pid>.txt every 5 s: per thread, the share of samples in which each function is on the stack
(inclusive) and the most frequent innermost stacks."""

import os
import sys
import threading
import time
from collections import Counter

_DIR = os.environ.get("HSBENCH_PROFILE")


def _frame_key(f):
    c = f.f_code
    return f"{os.path.basename(c.co_filename)}:{c.co_name}:{c.co_firstlineno}"


def _run():
    me = threading.get_ident()
    started = time.time()  # a start file left by an earlier run (older than this process) does not count
    while True:
        try:
            if os.stat(os.path.join(_DIR, "start")).st_mtime >= started - 1:
                break
        except OSError:
            pass
        time.sleep(0.1)
    period = float(os.environ.get("HSBENCH_PROFILE_MS", "1")) / 1000
    total, incl, leaf = Counter(), {}, {}
    last = time.monotonic()
    while True:
        time.sleep(period)
        for tid, f in sys._current_frames().items():
            if tid == me:
                continue
            stack = []
            while f is not None and len(stack) < 60:
                stack.append(_frame_key(f))
                f = f.f_back
            total[tid] += 1
            incl.setdefault(tid, Counter()).update(set(stack))
            leaf.setdefault(tid, Counter())[" < ".join(stack[:7])] += 1
        if time.monotonic() - last > 5:
            last = time.monotonic()
            names = {t.ident: t.name for t in threading.enumerate()}
            lines = [f"pid {os.getpid()} argv {sys.argv[:3]}"]
            for tid, n in total.most_common():
                if n < 50:
                    continue
                lines.append(f"\n== thread {names.get(tid, tid)}: {n} samples")
                lines += [f"  {c / n:6.1%}  {k}" for k, c in incl[tid].most_common(45)]
                lines.append("  -- innermost stacks")
                lines += [f"  {c / n:6.1%}  {k}" for k, c in leaf[tid].most_common(12)]
            tmp = os.path.join(_DIR, f"{os.getpid()}.tmp")
            with open(tmp, "w") as out:
                out.write("\n".join(lines) + "\n")
            os.replace(tmp, os.path.join(_DIR, f"{os.getpid()}.txt"))


if _DIR:
    threading.Thread(target=_run, name="hsbench-sampler", daemon=True).start()
