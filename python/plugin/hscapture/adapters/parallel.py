"""Parallel layouts hscapture refuses, checked before an engine starts (early_check.py) and in each worker."""

from __future__ import annotations

from ..errors import CompatibilityError


def refuse_stages_with_tp(pp_size: int, tp_size: int) -> None:
    """Pipeline stages with tensor parallelism are refused until the stages' rows are agreed before they are written:
    the last stage would write rows received from an earlier stage before that stage's TP ranks compared them."""
    if pp_size > 1 and tp_size > 1:
        raise CompatibilityError(
            f"pipeline parallelism ({pp_size} stages) with tensor parallelism ({tp_size} ranks per stage): hscapture "
            "would write the rows an earlier stage sends before that stage's tensor-parallel ranks agreed on them, so "
            "a diverged rank could reach the files; expected one of the two. Run with --tensor-parallel-size "
            f"{pp_size * tp_size} (or --pipeline-parallel-size {pp_size} and --tensor-parallel-size 1)"
        )
