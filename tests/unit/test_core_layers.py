"""The core's folders are its layers (docs/architecture.md): each imports only from those below it, so that
``capture/`` knows nothing of writing and ``output/`` nothing of attribution. Read from the sources, tests aside."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "crates" / "worker" / "src"
# Top to bottom; `failure` and `error` are the floor every layer may use.
LAYERS = ["py", "worker", "capture", "output", "attribution", "ranks", "sample"]
USE = re.compile(r"\bcrate::(\w+)")


def sources(layer: str) -> list[Path]:
    return [p for p in (SRC / layer).rglob("*.rs") if "tests" not in p.relative_to(SRC).parts]


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_imports_only_from_those_below_it(layer):
    above = set(LAYERS[: LAYERS.index(layer) + 1]) - {layer}
    found = []
    for p in sources(layer):
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if line.lstrip().startswith("//"):
                continue
            found += [f"{p.relative_to(SRC)}:{n}: crate::{m}" for m in USE.findall(line) if m in above]
    assert sources(layer), f"no sources under {layer}/: the layer list is stale"
    assert not found, f"{layer}/ imports from a layer above it:\n" + "\n".join(found)


def test_capture_knows_nothing_of_writing():
    """Capture hands finished samples on through ``sample::Handoff``; what becomes of them is output's business."""
    found = [
        f"{p.relative_to(SRC)}:{n}"
        for p in sources("capture")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if "crate::output" in line and not line.lstrip().startswith("//")
    ]
    assert not found, "capture/ imports output/: " + ", ".join(found)
