"""The output directory of an extraction: refused when it holds a capture unless ``--overwrite`` or
``--resume`` is given; with ``--overwrite`` the earlier capture is moved aside (one rename per entry, into
``OUT/.hscapture-replaced``) and removed only once the new run's engine has started, or moved back when
the run stops before that — so a refused run never costs the capture it was to replace."""

from __future__ import annotations

import shutil
from pathlib import Path

from .. import _native
from ..errors import ConfigError, OutputError

ASIDE = ".hscapture-replaced"
# What a capture consists of at the top of OUT, besides its format's sample files.
_OWN = (
    "hidden_states",
    _native.MANIFEST,
    "shard.json",
    _native.JOURNAL,
    "sample_lengths.json",
    "data_config.json",
    ".hscapture-errors",
)


def _entries(out: Path, fmt) -> list[Path]:
    """The entries of OUT that belong to a capture (its files, documents, ledger)."""
    found = [out / n for n in _OWN if (out / n).exists()]
    if not fmt.folder and out.is_dir():
        found += [p for p in out.iterdir() if fmt.index_of(p.name) is not None or _native.is_partial(p.name)]
    return found


def holds_capture(out: Path) -> bool:
    from ..output import formats

    return (
        (out / _native.MANIFEST).exists()
        or (out / _native.JOURNAL).exists()
        or any(f.holds_capture(out) for f in formats.FORMATS.values())
    )


def prepare(out: Path, overwrite: bool, resume: bool = False, fmt=None) -> Path | None:
    """Checks OUT for this run; returns where an overwritten capture was moved (see ``restore``/``discard``)."""
    from ..output import formats

    fmt = fmt or formats.get("hscapture")
    if overwrite and resume:
        raise ConfigError("--overwrite and --resume contradict each other: choose one")
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out} is a file, not a directory; choose a directory (it is created if missing)")
    existing = holds_capture(out)
    if existing and not (overwrite or resume):
        raise OutputError(
            f"{out} already holds captured states; pass --resume to continue that run (finished samples are kept), "
            "--overwrite to replace them, or choose another --out"
        )
    _probe(out / fmt.folder if fmt.folder else out)
    leftover = out / ASIDE
    if leftover.exists():  # an earlier --overwrite whose run was killed before it started: it wanted it gone
        shutil.rmtree(leftover, ignore_errors=True)
    aside = None
    if existing and overwrite:
        aside = leftover
        aside.mkdir()
        for f in {*(_entries(out, fmt)), *(e for other in formats.FORMATS.values() for e in _entries(out, other))}:
            f.rename(aside / f.name)
        _probe(out / fmt.folder if fmt.folder else out)
    if existing and resume:
        d = out / fmt.folder if fmt.folder else out
        for f in d.iterdir():
            if _native.is_partial(f.name):
                f.unlink(missing_ok=True)  # an interrupted write: never visible as a sample
    return aside


def _probe(target: Path) -> None:
    try:
        target.mkdir(parents=True, exist_ok=True)
        probe = target / ".hscapture-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise OutputError(f"cannot write to {target}: {e}; choose a directory you can write") from None


def restore(out: Path, aside: Path | None) -> None:
    """The run stopped before it started: the replaced capture goes back where it was."""
    if aside is None or not aside.is_dir():
        return
    for f in aside.iterdir():
        dst = out / f.name
        if dst.is_dir() and not any(dst.iterdir()):
            dst.rmdir()
        elif dst.exists():
            continue  # something the failed run made; the earlier capture's own entry stays aside
        f.rename(dst)
    shutil.rmtree(aside, ignore_errors=True)


def discard(aside: Path | None) -> None:
    """The new run started cleanly: the replaced capture is removed."""
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
