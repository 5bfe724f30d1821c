"""What an extraction settled before vLLM starts (`extract.py` builds it; `manifest.py` finishes with it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..output import formats


@dataclass
class Run:
    """What a run settled before vLLM starts: its input, format, layers, rows and what an earlier run left."""

    opts: object  # extract.ExtractOptions
    prompts: object
    fmt: formats.Format
    model_cfg: dict
    ids: list[int]
    rows: list[int]  # this run's rows of the input (a shard's, or all)
    out: Path
    checks: list[str]
    done: dict[int, dict] = field(default_factory=dict)  # rows an earlier run finished, with their records
    found_identity: dict | None = None  # the earlier run's settings, as its ledger holds them

    @property
    def todo(self) -> list[int]:
        return [i for i in self.rows if i not in self.done]
