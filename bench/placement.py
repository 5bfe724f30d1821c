"""Where the engine's thread runs, and what runs beside it (bench/gpu_run.py's `_pinned` and `_apart` modes).

Eager decode is host-bound: the engine's main thread is busy 80-95 % of a round, and in hscapture's connector modes it
used ~30 % more CPU for the same work without losing its core (few involuntary switches). Two causes would slow the
same instructions that way: the thread moving between CPUs (each move starts on cold L1/L2 caches) and another busy
thread on its core's SMT sibling (the two share one core's execution units). These modes separate them:

- `_pinned`: the worker's main thread on one CPU, every other thread where it was: no migrations of the engine's
  thread, siblings still shared;
- `_apart`: the same, and every other thread of the worker's process on CPUs of other physical cores: no migrations,
  no sibling shared with the engine's thread.

Each thread's migrations are read from `/proc/self/task/<tid>/sched` (`se.nr_migrations`), with the CPU topology from
`/sys/devices/system/cpu/cpu<N>/topology`.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

SYS_CPU = Path("/sys/devices/system/cpu")


def core_of(cpus: set[int], root: Path = SYS_CPU) -> dict[int, tuple[int, int]]:
    """Each CPU's physical core, as (package, core id); a CPU whose topology is unreadable is a core of its own."""
    out = {}
    for c in sorted(cpus):
        topo = root / f"cpu{c}" / "topology"
        try:
            out[c] = (int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text()))
        except (OSError, ValueError):
            out[c] = (-1, c)
    return out


def plan(how: str, allowed: set[int], cores: dict[int, tuple[int, int]]) -> tuple[set[int], set[int] | None]:
    """(the main thread's CPUs, the other threads' CPUs or None: left where they are) for `how` ("pinned" or
    "apart"). The main thread takes the lowest allowed CPU; `apart` gives the others every allowed CPU of another
    physical core, and is refused where none is left (one core, or its siblings only)."""
    if how not in ("pinned", "apart"):
        raise ValueError(f"placement {how!r}: expected 'pinned' or 'apart'")
    if not allowed:
        raise ValueError("no CPU is allowed to this process")
    main = min(allowed)
    if how == "pinned":
        return {main}, None
    rest = {c for c in allowed if cores.get(c, (-1, c)) != cores.get(main, (-1, main))}
    if not rest:
        raise ValueError(
            f"placement 'apart': the allowed CPUs {sorted(allowed)} are all on the main thread's physical core "
            f"(CPU {main}); expected at least one CPU of another core"
        )
    return {main}, rest


def place(worker, how: str) -> dict:  # noqa: ARG001 - called through collective_rpc, which passes the worker
    """Applied in the worker's process, on its main thread (collective_rpc runs there: the thread that executes the
    steps): that thread and the others placed as `plan` says. Threads that start later inherit their creator's CPUs
    (the main thread's: so call this again before each round). Returns what it did."""
    allowed = os.sched_getaffinity(0)
    cores = core_of(allowed)
    main_cpus, rest = plan(how, allowed, cores)
    me = threading.get_native_id()
    os.sched_setaffinity(me, main_cpus)
    moved = 0
    if rest is not None:
        for t in os.listdir("/proc/self/task"):
            if int(t) == me:
                continue
            try:
                os.sched_setaffinity(int(t), rest)
                moved += 1
            except OSError:  # a thread that ended meanwhile
                continue
    return {
        "how": how,
        "main_cpus": sorted(main_cpus),
        "other_cpus": sorted(rest) if rest is not None else "unchanged",
        "moved": moved,
        "main_core_siblings": sorted(c for c in allowed if cores[c] == cores[min(main_cpus)]),
    }


def migrations(tid: int | str) -> int | None:
    """How many times thread `tid` of this process moved between CPUs (`se.nr_migrations`); None if unreadable."""
    try:
        text = Path(f"/proc/self/task/{tid}/sched").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "se.nr_migrations":
            try:
                return int(value.strip())
            except ValueError:
                return None
    return None
