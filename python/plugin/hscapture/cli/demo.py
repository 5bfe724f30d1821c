"""``hscapture demo``: the whole path on an embedded default, checked against HF transformers.

Builds a tiny DeepSeek-V3-shaped model (MoE, YaRN, MLA dims) with fixed seeds, captures prompts of
assorted lengths through real vLLM at TP=2 with chunked prefill forced, then recomputes every token's
states with HF transformers and reports the worst relative error.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from .. import envs
from ..output.io import load_sample
from ..testing import tiny
from ..testing.compare import compare
from .extract import ExtractOptions, run_extract

TOLERANCE = 1e-3
LAYERS = [0, 1, 2, 4]  # before-convention: embeddings, two inner layers, the final output before the norm


def cache_dir() -> Path:
    return Path(envs.get("HSCAPTURE_CACHE") or Path.home() / ".cache" / "hscapture")


def demo_prompts(n: int = 12, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [3, 17, 64, 65, 150] + [rng.randint(2, 120) for _ in range(n - 5)]
    return [[rng.randrange(4, tiny.VOCAB) for _ in range(L)] for L in lengths]


def run_demo(out: Path, tp: int = 2, max_num_batched_tokens: int = 64) -> int:
    from ..testing import reference

    t0 = time.perf_counter()
    model = tiny.build("deepseek_v3", cache_dir() / "models" / "tiny-deepseek-v3", seed=0)
    prompts = demo_prompts()
    print(
        f"[demo] model {model} (tiny DeepSeek-V3 shape: MLA dims, MoE 8 experts + shared, YaRN), "
        f"{len(prompts)} prompts, TP={tp}, chunked prefill every {max_num_batched_tokens} tokens",
        flush=True,
    )
    rep = run_extract(
        ExtractOptions(
            model=str(model),
            prompts=prompts,
            out=str(out),
            convention="before",
            layers=LAYERS,
            tp=tp,
            dtype="float32",
            max_num_batched_tokens=max_num_batched_tokens,
            overwrite=True,
            progress=False,
        )
    )
    print("[demo] computing the reference with HF transformers ...", flush=True)
    refs = reference.compute_subprocess(str(model), prompts, rep.layer_ids, rep.convention, out / "reference")
    ours = []
    for i, p in enumerate(prompts):
        s = load_sample(out / "hidden_states" / f"hs_{i}.safetensors")
        if s["token_ids"].tolist() != p:
            print(f"[demo] FAIL: sample {i} token_ids differ from the prompt")
            return 1
        ours.append(s["hidden_states"])
    cmp = compare(ours, refs)
    tf_version = reference.reference_version(out / "reference")
    print("[demo] report")
    for line in rep.lines():
        print("  " + line)
    if rep.shims:
        print(f"  shims       {', '.join(rep.shims)}")
    print(f"  reference   HF transformers {tf_version}, float32, {cmp.tokens} tokens x {len(rep.layer_ids)} layers")
    s, t, slot = cmp.where
    print(
        f"  worst relative error {cmp.worst:.2e} (sample {s}, token {t}, layer id {rep.layer_ids[slot]}); "
        f"tolerance {TOLERANCE:.0e}: {'PASS' if cmp.ok(TOLERANCE) else 'FAIL'}"
    )
    print(f"  total       {time.perf_counter() - t0:.0f} s")
    return 0 if cmp.ok(TOLERANCE) else 1
