"""``--shard k/n``: data-parallel shards of one input. Shard ``k`` of ``n`` captures the rows ``i`` with
``i % n == k`` and keeps their global indices (``hs_{i}``, manifest ``index``); ``OUT/shard.json`` records
which shard of which input a directory holds, so that ``hscapture merge`` can check the set is whole."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import ConfigError, OutputError

FILE = "shard.json"


@dataclass(frozen=True)
class Shard:
    k: int
    n: int

    @classmethod
    def parse(cls, spec: str) -> Shard:
        try:
            k, n = (int(x) for x in spec.split("/"))
        except ValueError:
            raise ConfigError(
                f"--shard expects k/n such as 0/4 (shard k of n, counting from 0); found {spec!r}"
            ) from None
        if n < 1 or not 0 <= k < n:
            raise ConfigError(f"--shard {spec}: expected 0 <= k < n (shards are numbered 0..n-1)")
        return cls(k, n)

    def rows(self, total: int) -> list[int]:
        return list(range(self.k, total, self.n))

    def __str__(self) -> str:
        return f"{self.k}/{self.n}"


@dataclass
class ShardInfo:
    """What ``OUT/shard.json`` holds."""

    shard: int
    of: int
    rows: int  # rows of the whole input
    input: str
    input_fingerprint: str
    format: str  # hscapture | legacy

    def write(self, out: Path) -> None:
        from ..output.formats import write_json

        write_json(out / FILE, asdict(self))

    @classmethod
    def read(cls, out: Path) -> ShardInfo | None:
        p = out / FILE
        if not p.exists():
            return None
        try:
            return cls(**json.loads(p.read_text()))
        except (ValueError, TypeError) as e:
            raise OutputError(
                f"{p} is not a shard record ({e}); it may be damaged: re-run that shard with --overwrite"
            ) from None


def check_resume(out: Path, now: ShardInfo | None) -> None:
    """A resumed run must be the same shard of the same input as the run it continues. (A sharded run killed
    before it wrote ``shard.json`` left none: accepted.)"""
    before = ShardInfo.read(out)
    if before is None:
        return
    if now is None:
        raise ConfigError(
            f"{out} holds shard {before.shard}/{before.of}; this run is unsharded: resume with "
            f"--shard {before.shard}/{before.of}, or use --overwrite / another --out"
        )
    a, b = asdict(before), asdict(now)
    diff = [k for k in a if k != "input" and a[k] != b[k]]
    if diff:
        raise ConfigError(
            f"{out} holds shard {before.shard}/{before.of} of another run ({', '.join(f'{k}: {a[k]} vs {b[k]}' for k in diff)}); "
            "resume with the same input and --shard, or use --overwrite / another --out"
        )
