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
- the busiest host thread's work (the engine's thread): each operator's and CUDA call's self time (its duration less
  the traced events inside it), and the thread's time inside no traced event (Python between operators).
With several traces, the host side of each is compared with the first mode named ``plain`` (else the first trace):
per operator, calls and mean self µs in both, and where the difference in total self time went; an operator that
got uniformly slower (every aten op ~+30 %) points at the machine (caches, another thread), one that got more calls
or longer alone at the code that calls it.
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


def host_self(events: list[dict]) -> tuple[str, dict[str, list[float]], float, float]:
    """The busiest host thread (most cpu_op time): (its id, name -> [calls, self µs], its span µs, µs inside no
    traced event)."""
    nested = [e for e in events if e.get("cat") in HOST_WHILE]
    busy = Counter()
    for e in nested:
        if e.get("cat") == "cpu_op":
            busy[(e.get("pid"), e.get("tid"))] += float(e["dur"])
    if not busy:
        return "-", {}, 0.0, 0.0
    thread = busy.most_common(1)[0][0]
    mine = sorted(
        (e for e in nested if (e.get("pid"), e.get("tid")) == thread), key=lambda e: (float(e["ts"]), -float(e["dur"]))
    )
    table: dict[str, list[float]] = {}
    stack: list[tuple[float, str]] = []  # (end, key) of the open events
    covered, top_end = 0.0, None
    for e in mine:
        s, d = float(e["ts"]), float(e["dur"])
        while stack and stack[-1][0] <= s:
            stack.pop()
        key = f"{e.get('cat')}:{e['name'][:70]}"
        if key.startswith("user_annotation:execute_context"):
            key = "user_annotation:execute_context (a step)"
        row = table.setdefault(key, [0, 0.0])
        row[0] += 1
        row[1] += d
        if stack:  # inside its parent: the parent's self time loses it
            table[stack[-1][1]][1] -= min(d, stack[-1][0] - s)
        else:
            covered += d if top_end is None or s >= top_end else max(0.0, s + d - top_end)
            top_end = s + d if top_end is None else max(top_end, s + d)
        stack.append((s + d, key))
    span = max(float(e["ts"]) + float(e["dur"]) for e in mine) - float(mine[0]["ts"])
    return f"{thread[0]}/{thread[1]}", table, span, span - covered


def compare(base: tuple[str, dict], other: tuple[str, dict], top: int = 30) -> str:
    """Per host event, the busiest thread's calls and mean self time in both traces; largest total differences."""
    (bn, b), (on, o) = base, other
    rows = []
    for k in set(b) | set(o):
        bc, bs = b.get(k, [0, 0.0])
        oc, os_ = o.get(k, [0, 0.0])
        rows.append((os_ - bs, k, bc, bs, oc, os_))
    rows.sort(key=lambda r: -abs(r[0]))
    total = sum(r[0] for r in rows)
    lines = [f"host self time, {on} against {bn}: {total / 1e3:+.1f} ms in all; largest differences:"]
    for diff, k, bc, bs, oc, os_ in rows[:top]:
        bm = bs / bc if bc else 0.0
        om = os_ / oc if oc else 0.0
        ratio = f"{om / bm:.2f}×" if bm > 0 else "new"
        lines.append(
            f"  {diff / 1e3:+8.1f} ms  {k}: calls {int(bc)} → {int(oc)}, mean self {bm:.1f} → {om:.1f} µs ({ratio})"
        )
    # The common aten operators, pooled: did every one of them get slower by about the same factor?
    common = [k for k in b if k in o and k.startswith("cpu_op:aten::") and b[k][0] >= 100 and o[k][0] >= 100]
    if common:
        bsum = sum(b[k][1] / b[k][0] for k in common)
        osum = sum(o[k][1] / o[k][0] for k in common)
        lines.append(f"  aten operators called ≥100 times in both ({len(common)}): mean self time × {osum / bsum:.3f}")
    return "\n".join(lines)


def report(path: Path, hosts: list | None = None) -> str:
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
    thread, table, tspan, outside = host_self(events)
    if table:
        lines.append(
            f"  busiest host thread {thread}: span {tspan / 1e3:.1f} ms, inside no traced event {outside / 1e3:.1f} ms; "
            "self time: "
            + ", ".join(
                f"{k} {v[1] / 1e3:.1f} ms/{int(v[0])}" for k, v in sorted(table.items(), key=lambda kv: -kv[1][1])[:8]
            )
        )
        table["(inside no traced event)"] = [1, outside]
        if hosts is not None:
            hosts.append((path.parent.name, table))
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
    found, hosts = False, []
    for d in argv:
        for p in sorted(Path(d).rglob("*.json*")):
            if ".json" in p.name:
                found = True
                try:
                    print(report(p, hosts), flush=True)
                except (OSError, EOFError, ValueError, KeyError) as e:  # a trace cut short by a limit
                    print(f"{p}: unreadable trace: {e}", flush=True)
    if not found:
        print(f"no trace under {' '.join(argv)}")
    if len(hosts) > 1:
        base = next((h for h in hosts if h[0] == "plain"), hosts[0])
        for h in hosts:
            if h is not base:
                print(compare(base, h), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
