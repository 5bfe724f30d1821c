"""Helpers shared by the integration tests."""

from __future__ import annotations

import random
import sys
from pathlib import Path

TOL = 1e-3


def prompts(seed: int, lengths=(5, 40, 77, 12, 64, 1)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 1024) for _ in range(n)] for n in lengths]


def extract(tmp_path: Path, model: str, ps, *, tp: int, convention: str, layers, chunk: int = 32, **kw):
    """Runs the extraction path (`hscapture extract`'s library function); returns (report, samples)."""
    from hscapture import load_sample
    from hscapture.cli.extract import ExtractOptions, run_extract

    rep = run_extract(
        ExtractOptions(
            model=model,
            prompts=ps,
            out=str(tmp_path / "out"),
            convention=convention,
            layers=layers,
            tp=tp,
            dtype="float32",
            max_num_batched_tokens=chunk,
            progress=False,
            durable=False,
            **kw,
        )
    )
    samples = [load_sample(tmp_path / "out" / "hidden_states" / f"hs_{i}.safetensors") for i in range(len(ps))]
    return rep, samples


def reference(tmp_path: Path, model: str, ps, layer_ids, convention):
    from hscapture.testing import reference as ref

    return ref.compute_subprocess(model, ps, list(layer_ids), convention, tmp_path / "ref")


def assert_matches_reference(tmp_path: Path, model: str, ps, rep, samples, layers, convention: str) -> None:
    """Every prompt has its sample, of the right tokens and shape, equal to HF transformers' states."""
    from hscapture.testing.compare import compare

    assert rep.samples == len(ps) and rep.tokens == sum(map(len, ps))
    for p, s in zip(ps, samples, strict=True):
        assert s["token_ids"].tolist() == p
        assert tuple(s["hidden_states"].shape) == (len(p), len(layers), 128)
    cmp = compare([s["hidden_states"] for s in samples], reference(tmp_path, model, ps, rep.layer_ids, convention))
    assert cmp.ok(TOL), f"worst relative error {cmp.worst:.2e} at (sample, token, slot) {cmp.where}"


def cli_extract(model, inp, out, *extra) -> list[str]:
    """`hscapture extract` of a tiny model, layers 1,3 (after), float32, 32-token steps, as a command line."""
    cmd = [sys.executable, "-m", "hscapture.cli.main", "extract", "--model", model, "--input", str(inp)]
    cmd += ["--out", str(out), "--layers", "1,3", "--convention", "after", "--dtype", "float32"]
    return cmd + ["--max-num-batched-tokens", "32", *extra]
