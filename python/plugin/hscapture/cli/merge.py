"""``hscapture merge OUT SHARD_DIR...``: the shards of one input (``extract --shard k/n``) into one capture.

Every shard must be finished (its manifest written) and agree on the settings; together they must hold each row
of the input exactly once. Files are hard-linked into ``OUT`` (``--move``: renamed), each under a temporary name
then renamed into place; a copy replaces the link across file systems. The merged manifest is written last: a
merge that stops half-way leaves no manifest and can simply be run again.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .. import _native
from ..errors import ConfigError, OutputError
from ..output import formats
from ..output.outlock import OutputLock
from .shard import ShardInfo

SETTINGS = ("layer_ids", "convention", "dtype", "hidden_size", "num_hidden_layers", "tensor_parallel_size")


@dataclass
class MergeReport:
    out: str
    shards: int
    samples: int
    tokens: int
    bytes: int
    linked: int
    copied: int
    moved: int

    def lines(self) -> list[str]:
        how = ", ".join(
            f"{n} {w}" for n, w in ((self.linked, "hard-linked"), (self.moved, "moved"), (self.copied, "copied")) if n
        )
        return [
            f"merged      {self.shards} shards -> {self.out}",
            f"samples     {self.samples} (every row of the input once)",
            f"tokens      {self.tokens}",
            f"bytes       {self.bytes} ({self.bytes / 2**30:.2f} GiB; {how or 'nothing to place'})",
            f"next        hscapture verify {self.out}",
        ]


def _load(d: Path) -> tuple[dict, ShardInfo]:
    if not (d / _native.MANIFEST).exists():
        raise OutputError(
            f"{d} has no manifest.json: that shard did not finish; run its extract again with --resume, then merge"
        )
    info = ShardInfo.read(d)
    if info is None:
        raise ConfigError(
            f"{d} has no shard.json: it was not written by `extract --shard k/n`; merge takes the shard "
            "directories of one sharded input"
        )
    return json.loads(_native.read_manifest(str(d / _native.MANIFEST))), info


def check(dirs: list[Path]) -> tuple[list[tuple[Path, dict, ShardInfo]], dict]:
    """Loads and cross-checks the shards; returns them and the first manifest (the settings)."""
    if not dirs:
        raise ConfigError("merge needs at least one shard directory")
    shards = [(d, *_load(d)) for d in dirs]
    d0, m0, i0 = shards[0]
    for d, m, info in shards[1:]:
        for what, a, b in [
            ("input rows", i0.rows, info.rows),
            ("input fingerprint", i0.input_fingerprint, info.input_fingerprint),
            ("shard count", i0.of, info.of),
            ("format", i0.format, info.format),
            ("model", Path(m0["model"]).name, Path(m["model"]).name),
        ] + [(k, m0[k], m[k]) for k in SETTINGS]:
            if a != b:
                raise ConfigError(
                    f"{d} and {d0} differ in {what} ({b!r} vs {a!r}): they are not shards of one run; "
                    "merge only the shards of one input run with the same settings"
                )
    seen: dict[int, Path] = {}
    for d, _, info in shards:
        if info.shard in seen:
            raise ConfigError(
                f"shard {info.shard}/{info.of} is given twice ({seen[info.shard]} and {d}); give each once"
            )
        seen[info.shard] = d
    missing = sorted(set(range(i0.of)) - set(seen))
    if missing:
        raise ConfigError(f"shards {missing} of {i0.of} are missing (given: {sorted(seen)}); run and pass every shard")
    owner: dict[int, Path] = {}
    for d, m, info in shards:
        for r in m["samples"]:
            i = r.get("index")
            if i is None or i % info.of != info.shard:
                raise OutputError(
                    f"{d}/manifest.json lists sample {i}, which is not a row of shard {info.shard}/{info.of}; "
                    "the shard directory was mixed with another run: re-run that shard with --overwrite"
                )
            if i in owner:
                raise OutputError(f"sample {i} is in {owner[i]} and in {d}; each row must come from one shard")
            owner[i] = d
    absent = sorted(set(range(i0.rows)) - set(owner))
    if absent:
        raise OutputError(
            f"{len(absent)} of {i0.rows} rows have no sample in any shard (first: {absent[:10]}); resume the "
            "shards that miss them (extract --shard k/n --resume), then merge"
        )
    return shards, m0


def _place(src: Path, dst: Path, size: int, move: bool) -> str:
    """Puts ``src`` at ``dst`` atomically; returns how (linked, moved, copied)."""
    if not src.exists():
        if move and dst.exists() and dst.stat().st_size == size:
            return "moved"  # an earlier, interrupted merge moved it already
        raise OutputError(f"{src} is listed in its shard's manifest but missing; run hscapture verify on that shard")
    if src.stat().st_size != size:
        raise OutputError(
            f"{src} has {src.stat().st_size} bytes, its manifest says {size}: the file changed; run "
            "hscapture verify on that shard"
        )
    tmp = Path(_native.partial_path(str(dst)))
    tmp.unlink(missing_ok=True)
    try:
        if move:
            os.replace(src, dst)
            return "moved"
        os.link(src, tmp)
        how = "linked"
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise OutputError(f"cannot place {src} at {dst}: {e}") from None
        with open(src, "rb") as a, open(tmp, "wb") as b:
            shutil.copyfileobj(a, b, 16 << 20)
            b.flush()
            os.fsync(b.fileno())
        how = "copied"
        if move:
            src.unlink()
    os.replace(tmp, dst)
    return how


def run_merge(out: Path, dirs: list[Path], move: bool = False) -> MergeReport:
    out = out.resolve()
    dirs = [d.resolve() for d in dirs]
    if out in dirs:
        raise ConfigError(f"the merge output {out} is one of the shards; choose a new directory")
    if (out / _native.MANIFEST).exists():
        raise OutputError(f"{out} already holds a capture (manifest.json); choose another output directory")
    shards, m0 = check(dirs)
    locks = [OutputLock(out).acquire()]
    try:
        locks += [OutputLock(d).acquire() for d in dirs]
        return _merge(out, shards, m0, move)
    finally:
        for lk in locks:
            lk.release()


def _merge(out: Path, shards, m0: dict, move: bool) -> MergeReport:
    fmt = shards[0][2].format
    counts = {"linked": 0, "copied": 0, "moved": 0}
    records = []
    dirs_touched = set()
    for d, m, _ in shards:
        for r in m["samples"]:
            dst = out / r["file"]
            dst.parent.mkdir(parents=True, exist_ok=True)
            dirs_touched.add(dst.parent)
            counts[_place(d / r["file"], dst, r["bytes"], move)] += 1
            records.append(r)
    for p in dirs_touched:
        _native.sync_dir(str(p))
    formats.get(fmt).merge_documents(out, shards[0][0], records, [d for d, _, _ in shards])
    manifest = dict(m0)
    manifest["samples"] = records
    manifest["created_by"] = {**m0.get("created_by", {}), "merge": f"{len(shards)} shards"}
    _native.write_manifest(str(out / _native.MANIFEST), json.dumps(manifest))
    return MergeReport(
        out=str(out),
        shards=len(shards),
        samples=len(records),
        tokens=sum(r["length"] for r in records),
        bytes=sum(r["bytes"] for r in records),
        **counts,
    )
