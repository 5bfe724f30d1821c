"""Where a profiled step's time went on the GPU, from torch profiler traces (diagnosis, not a benchmark figure).

    python bench/trace_gaps.py DIR [DIR ...]     # each DIR: one mode's torch_profiler_dir (*.pt.trace.json[.gz])

For each trace, over the span from the first to the last GPU activity:
- busy: the union of every kernel, memcpy and memset interval, on any stream, and the share of the span it covers;
  idle gaps between GPU activity by length (a GPU that idles between launches shows here, a slower step does not);
- per stream: busy time, activity count, bytes its copies moved, and the longest activities by name;
- host side: the CUDA runtime and driver calls that took longest in total (a synchronising copy or event wait shows
  as a long ``cudaMemcpyAsync`` / ``cuMemcpyHtoDAsync`` / ``cudaStreamSynchronize``), and how many graphs were
  launched against eager kernel launches (FULL graphs in decode: one graph launch a step, few kernel launches);
- the longest idle gaps: where in the span, the GPU activity either side, and what the host was doing meanwhile (the
  host events that overlap the gap most: CUDA calls, operators, vLLM's annotations).
Prints one block per trace; reads nothing else and writes nothing."""

import gzip
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATS = {"cuda_runtime", "cuda_driver"}
# What the host did during a GPU gap: these events overlapping it, longest overlap first.
HOST_WHILE = HOST_CATS | {"cpu_op", "user_annotation", "python_function"}
LONGEST_GAPS = 6
GAP_EDGES_US = (10, 100, 1_000, 10_000)


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f).get("traceEvents", [])


def union(intervals: list[tuple[float, float]], where: list | None = None) -> tuple[float, list[float]]:
    """Total covered length and the gaps between covered runs (``where``, if given, gets each gap's (start, end))."""
    busy, gaps, end = 0.0, [], None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                gaps.append(s - end)
                if where is not None:
                    where.append((end, s))
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy, gaps


def gap_histogram(gaps: list[float]) -> str:
    parts, lo = [], 0
    for hi in (*GAP_EDGES_US, float("inf")):
        sel = [g for g in gaps if lo <= g < hi]
        name = f"≥{lo:,} µs" if hi == float("inf") else f"{lo:,}–{hi:,} µs"
        parts.append(f"{name}: {len(sel)} ({sum(sel) / 1e3:.1f} ms)")
        lo = hi
    return "; ".join(parts)


def report(path: Path) -> str:
    events = [e for e in load(path) if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    host = [e for e in events if e.get("cat") in HOST_CATS]
    if not gpu:
        return f"{path}: no GPU activity in the trace"
    iv = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu]
    span = max(e for _, e in iv) - min(s for s, _ in iv)
    spans: list[tuple[float, float]] = []
    busy, gaps = union(iv, spans)
    lines = [
        f"{path}",
        f"  GPU span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms ({100 * busy / span:.1f}%), "
        f"idle {(span - busy) / 1e3:.1f} ms in {len(gaps)} gaps",
        f"  idle gaps: {gap_histogram(gaps)}",
    ]
    by_stream: dict[object, list[dict]] = defaultdict(list)
    for e in gpu:
        by_stream[(e.get("args") or {}).get("stream", e.get("tid"))].append(e)
    for stream, evs in sorted(by_stream.items(), key=lambda kv: -sum(float(e["dur"]) for e in kv[1])):
        sb, _ = union([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in evs])
        names = Counter()
        for e in evs:
            names[e["name"][:70]] += float(e["dur"])
        top = ", ".join(f"{n} {d / 1e3:.1f} ms" for n, d in names.most_common(4))
        copied = sum(int((e.get("args") or {}).get("bytes", 0)) for e in evs if e.get("cat") == "gpu_memcpy")
        moved = f", copies move {copied / 1e6:,.1f} MB" if copied else ""
        lines.append(f"  stream {stream}: busy {sb / 1e3:.1f} ms, {len(evs)} activities{moved}; {top}")
    calls, counts = Counter(), Counter()
    for e in host:
        calls[e["name"]] += float(e["dur"])
        counts[e["name"]] += 1
    lines.append(
        "  host CUDA calls by total time: "
        + ", ".join(f"{n} {d / 1e3:.1f} ms/{counts[n]}" for n, d in calls.most_common(8))
    )
    graphs = sum(v for k, v in counts.items() if "GraphLaunch" in k)
    launches = sum(
        v
        for k, v in counts.items()
        if k in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
    )
    lines.append(f"  graph launches {graphs}, eager kernel launches {launches}")
    lines += longest_gaps(spans, gpu, [e for e in events if e.get("cat") in HOST_WHILE], min(s for s, _ in iv))
    return "\n".join(lines)


def longest_gaps(spans: list[tuple[float, float]], gpu: list[dict], host: list[dict], t0: float) -> list[str]:
    """The longest GPU idle gaps: when (ms into the span), the GPU activity ending before and starting after, and the
    host events overlapping each most."""
    ends = sorted(gpu, key=lambda e: float(e["ts"]) + float(e["dur"]))
    starts = sorted(gpu, key=lambda e: float(e["ts"]))
    out = [f"  longest idle gaps ({min(LONGEST_GAPS, len(spans))} of {len(spans)}):"]
    for a, b in sorted(spans, key=lambda g: g[0] - g[1])[:LONGEST_GAPS]:
        before = max(
            (e for e in ends if float(e["ts"]) + float(e["dur"]) <= a + 0.5),
            default=None,
            key=lambda e: float(e["ts"]) + float(e["dur"]),
        )
        after = next((e for e in starts if float(e["ts"]) >= b - 0.5), None)
        over = Counter()
        for e in host:
            s, d = float(e["ts"]), float(e["dur"])
            o = min(b, s + d) - max(a, s)
            if o > 0:
                over[f"{e.get('cat')}:{e['name'][:60]}"] += o
        meanwhile = ", ".join(f"{n} {o / 1e3:.2f} ms" for n, o in over.most_common(5)) or "nothing traced"
        name = lambda e: e["name"][:50] if e else "-"  # noqa: E731
        out.append(
            f"    {(b - a) / 1e3:.2f} ms at {(a - t0) / 1e3:.1f} ms: after {name(before)}, before {name(after)}; "
            f"host meanwhile: {meanwhile}"
        )
    return out


def main(argv: list[str]) -> int:
    found = False
    for d in argv:
        for p in sorted(Path(d).rglob("*.json*")):
            if ".json" in p.name:
                found = True
                try:
                    print(report(p), flush=True)
                except (OSError, EOFError, ValueError, KeyError) as e:  # a trace cut short by a limit
                    print(f"{p}: unreadable trace: {e}", flush=True)
    if not found:
        print(f"no trace under {' '.join(argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
