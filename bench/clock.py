"""The clock the engine's thread ran at (bench/gpu_run.py): is eager decode's slower engine thread a slower core?

In hscapture's connector modes the engine's thread did the same work ~30 % slower, without losing its core and
without more page faults or TLB shootdowns. One cause would slow every instruction alike: the core's clock. A CPU's
turbo frequency falls as more of its cores are busy, and the capture's threads (the assembler, the writers, the
kernel's writeback of the files) keep more cores busy than plain vLLM does.

A thread in the driver's process samples, every ``period`` seconds, which CPU the engine's thread last ran on
(``/proc/<pid>/task/<tid>/stat``, field 39) and that CPU's clock (``/proc/cpuinfo``'s ``cpu MHz``: the effective
frequency from APERF/MPERF where the kernel reads them), and every CPU's. A machine whose ``cpu MHz`` is a constant
(some virtual machines) shows no spread: ``distinct`` says how many values it ever read.
"""

from __future__ import annotations

import threading
from pathlib import Path


def cpu_mhz(text: str) -> dict[int, float]:
    """Each CPU's ``cpu MHz`` from ``/proc/cpuinfo``'s text."""
    out, cpu = {}, None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            cpu = int(value)
        elif key == "cpu MHz" and cpu is not None:
            out[cpu] = float(value)
    return out


def last_cpu(stat: str) -> int:
    """The CPU a thread last ran on, from its ``/proc/.../stat`` line (field 39; the name in parentheses may hold
    spaces, so fields are counted after its closing parenthesis)."""
    return int(stat.rpartition(")")[2].split()[36])


class ClockSampler:
    """Samples the engine thread's CPU clock and every CPU's from a thread of its own, between ``start()`` and
    ``stop()``; ``summary()`` is the mean over the samples."""

    def __init__(self, pid: int, tid: int, period: float = 0.1, root: Path = Path("/proc")) -> None:
        self.stat, self.cpuinfo, self.period = root / str(pid) / "task" / str(tid) / "stat", root / "cpuinfo", period
        self.engine: list[float] = []
        self.machine: list[float] = []
        self.busiest: list[float] = []  # the mean of the fastest half of the CPUs: the busy cores' clock
        self.seen: set[float] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        try:
            cpu, mhz = last_cpu(self.stat.read_text()), cpu_mhz(self.cpuinfo.read_text())
        except (OSError, ValueError, IndexError):
            return  # the engine's thread ended, or a kernel without these fields: no sample
        if cpu not in mhz:
            return
        values = sorted(mhz.values(), reverse=True)
        self.engine.append(mhz[cpu])
        self.machine.append(sum(values) / len(values))
        top = values[: max(1, len(values) // 2)]
        self.busiest.append(sum(top) / len(top))
        self.seen.update(values)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def start(self) -> ClockSampler:
        self._thread = threading.Thread(target=self._run, name="bench-clock", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)

    def summary(self) -> dict | None:
        if not self.engine:
            return None

        def mean(xs: list[float]) -> float:
            return round(sum(xs) / len(xs))

        return {
            "engine_cpu_mhz": mean(self.engine),
            "engine_cpu_mhz_min": round(min(self.engine)),
            "all_cpus_mhz": mean(self.machine),
            "fastest_half_mhz": mean(self.busiest),
            "samples": len(self.engine),
            "distinct": len(self.seen),
        }
