"""What a user sees of a run: a progress bar on a terminal (tqdm), plain log lines every N seconds otherwise,
and the end report.

The progress is the driver's own view: a request that finished its prefill has had its states captured and
handed to the writer (whose queue is bounded, ``writer_queue``), so samples, tokens and bytes count finished
requests, bytes being ``tokens x layers x hidden x dtype size`` (the files add a small header). The end report's
figures are the writer's records of the files on disk.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

from .. import _native


def _hms(s: float) -> str:
    return str(timedelta(seconds=int(s))) if s == s and s != float("inf") else "?"


def _rate(r: float) -> str:
    return f"{r:,.0f}" if r == r else "?"


class Progress:
    """Counts finished samples; draws a bar (``interactive``) or prints a line every ``every`` seconds."""

    def __init__(
        self,
        samples: int,
        tokens: int,
        bytes_per_token: int,
        *,
        interactive: bool,
        every: float = 30.0,
        stream=None,
        label: str = "capture",
    ) -> None:
        self.total_samples, self.total_tokens, self.bpt = samples, tokens, bytes_per_token
        self.samples = self.tokens = 0
        self.every, self.stream = every, stream or sys.stdout
        self.t0 = time.monotonic()
        self._last = self.t0
        self._first: tuple[float, int] | None = None  # (time, tokens) at the first finished request
        self._closed_rate: float | None = None
        self._bar = None
        if interactive:
            from tqdm import tqdm

            self._bar = tqdm(
                total=samples,
                desc=label,
                unit="sample",
                file=self.stream,
                dynamic_ncols=True,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} samples [{elapsed}{postfix}]",
            )

    def _figures(self) -> tuple[float, float, float]:
        """tokens/s since the first request finished (the warm-up before it, the first forward, would distort the
        rate and the ETA for hours), GB handed to the writer, seconds left."""
        rate = float("nan")
        if self._first is not None and time.monotonic() - self._first[0] > 1e-3:
            rate = (self.tokens - self._first[1]) / (time.monotonic() - self._first[0])
        eta = (self.total_tokens - self.tokens) / rate if rate > 0 else float("nan")
        return rate, self.tokens * self.bpt / 1e9, eta

    def steady_rate(self) -> float:
        """tokens/s since the first request finished, up to ``close`` (NaN before a second step)."""
        return self._closed_rate if self._closed_rate is not None else self._figures()[0]

    def line(self) -> str:
        rate, gb, eta = self._figures()
        pct = 100.0 * self.samples / self.total_samples if self.total_samples else 100.0
        return (
            f"[hscapture] {self.samples}/{self.total_samples} samples ({pct:.1f}%), {self.tokens:,} tokens, "
            f"{_rate(rate)} tokens/s, {gb:.3f} GB, elapsed {_hms(time.monotonic() - self.t0)}, ETA {_hms(eta)}"
        )

    def update(self, samples: int, tokens: int) -> None:
        if self._first is None:
            self._first = (time.monotonic(), tokens)
        self.samples += samples
        self.tokens += tokens
        now = time.monotonic()
        if self._bar is not None:
            self._bar.update(samples)
            if now - self._last >= 0.5 or self.samples == self.total_samples:
                rate, gb, eta = self._figures()
                self._bar.set_postfix_str(f"{_rate(rate)} tok/s, {gb:.2f} GB, ETA {_hms(eta)}", refresh=False)
                self._last = now
        elif now - self._last >= self.every:
            print(self.line(), file=self.stream, flush=True)
            self._last = now

    def close(self) -> None:
        if self._closed_rate is None:
            self._closed_rate = self._figures()[0]
        if self._bar is not None:
            rate, gb, _ = self._figures()
            self._bar.set_postfix_str(f"{_rate(rate)} tok/s, {gb:.2f} GB", refresh=True)
            self._bar.close()
            self._bar = None
        else:
            print(self.line(), file=self.stream, flush=True)


@dataclass
class ExtractReport:
    out: str
    samples: int
    tokens: int
    bytes: int
    seconds: float
    layer_ids: list[int]
    convention: str
    dtype: str
    shims: list[str]
    device_path: str = "none"
    traced_calls: int | None = None  # under torch.compile: taps of the compiled graph during captured steps
    resumed: int = 0
    format: str = _native.DEFAULTS["format"]
    shard: str | None = None
    skipped: int = 0  # samples not written for NaN/Inf values (--on-nonfinite skip)
    compressed: bool = False
    checks: list[str] = field(default_factory=list)
    steady_tokens_per_s: float = float("nan")  # after the first forward (its warm-up excluded), when measured

    @property
    def where(self) -> str:
        from ..output.formats import get

        fmt = get(self.format)
        return f"{self.out}/{fmt.file_pattern}" + "".join(f" + {d}" for d in fmt.documents) + " + " + _native.MANIFEST

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def lines(self) -> list[str]:
        out = [
            f"samples     {self.samples}"
            + (f" (+{self.resumed} finished earlier, kept)" if self.resumed else "")
            + (
                f"; {self.skipped} skipped for NaN/Inf values (listed in the manifest, retried by --resume)"
                if self.skipped
                else ""
            ),
            f"tokens      {self.tokens}",
            f"bytes       {self.bytes} ({self.bytes / 2**20:.1f} MiB)",
            f"throughput  {self.tokens_per_s:,.0f} tokens/s ({self.seconds:.1f} s capture"
            + (
                f"; {self.steady_tokens_per_s:,.0f} tokens/s after the first forward)"
                if self.steady_tokens_per_s == self.steady_tokens_per_s
                else ")"
            ),
            f"layers      {self.layer_ids} ({self.convention} convention), {self.dtype}",
        ]
        if self.traced_calls is not None:
            out.append(
                f"compiled    torch.compile on; the compiled graph's taps in captured steps: {self.traced_calls}"
            )
        if self.shard:
            out.append(f"shard       {self.shard} (global row indices; combine with hscapture merge)")
        out += [f"checks      {c}" for c in self.checks]
        out.append(f"output      {self.where}")
        if self.compressed:
            out.append(
                "compressed  states stored as `hidden_states.zst` (byte planes + zstd): read them with "
                "hscapture.load_sample; safetensors.load_file alone sees only the compressed bytes"
            )
        return out
