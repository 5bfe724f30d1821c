"""Captured states equal HF transformers' token by token (float32, relative error <= 1e-3), for fused-residual
architectures and two whose layers return the stream whole, TP=1 and TP=2, both conventions, chunked prefill forced, prompts of mixed lengths; and through
vLLM's Transformers modeling backend."""

from __future__ import annotations

import pytest
from helpers import TOL, assert_matches_reference, extract, prompts, reference

from hscapture.testing.compare import compare
from support import MOE_FLOAT32_REASON, moe_float32_runs

# On the newest vLLM: the model adapters (Llama at TP 1, DeepSeek where it runs, compiled, the Transformers backend);
# the other convention at TP 2 is version-independent (TP 2 itself runs there in test_output_tokens and the connector).
pytestmark = [pytest.mark.integration]
NEWEST = pytest.mark.newest

CASES = [
    # model, tp, convention, layers
    pytest.param("llama", 1, "before", [0, 2, 4], marks=NEWEST),
    ("llama", 2, "after", [0, 1, 3]),
    pytest.param(
        "deepseek_v2",
        1,
        "after",
        [0, 2, 3],
        marks=[NEWEST, pytest.mark.skipif(not moe_float32_runs(), reason=MOE_FLOAT32_REASON)],
    ),
    # MoE at TP=2 in float32: the experts are split across the ranks and reduced; what hscapture captures must
    # still equal transformers token by token (on the H200s, bf16 TP=2 vs TP=1 differs on a few MoE tokens and
    # MLA has no float32 kernel there, so this is where the float32 MoE TP=2 check runs)
    pytest.param(
        "deepseek_v2",
        2,
        "after",
        [0, 2, 3],
        marks=[NEWEST, pytest.mark.skipif(not moe_float32_runs(), reason=MOE_FLOAT32_REASON)],
    ),
    # Layers that return the stream whole beside a stale intermediate: summing the two would store the stream plus a
    # copy of an earlier one (adapters/layer_output.py). Exaone 4 overwrites the residual it takes; StableLM takes none.
    pytest.param("exaone4", 1, "after", [0, 1, 3], marks=NEWEST),
    pytest.param("stablelm", 1, "before", [1, 2, 4], marks=NEWEST),
]


@pytest.mark.parametrize(
    "kind,tp,convention,layers",
    CASES,
    ids=[
        "llama-tp1-before",
        "llama-tp2-after",
        "deepseek_v2-tp1-after",
        "deepseek_v2-tp2-after",
        "exaone4-tp1-after",
        "stablelm-tp1-before",
    ],
)
def test_matches_transformers(tmp_path, tiny_model, kind, tp, convention, layers):
    model = tiny_model(kind)
    ps = prompts(seed=tp)
    rep, samples = extract(tmp_path, model, ps, tp=tp, convention=convention, layers=layers)
    assert_matches_reference(tmp_path, model, ps, rep, samples, layers, convention)
    # The classic off-by-one: the same ids read in the other convention are other layers; the check is sharp.
    if convention == "after":
        mixed_up = reference(tmp_path, model, ps, rep.layer_ids, "before")
        assert not compare([s["hidden_states"] for s in samples], mixed_up).ok(TOL)


@NEWEST
def test_compiled_matches_transformers(tmp_path, tiny_model):
    """vLLM's torch.compile on (the CPU platform traces once and compiles with inductor): the hooks are traced
    into the graph and call hscapture's ops, which see each forward's tensors; the capture equals
    transformers exactly as in eager mode, chunked prefill and both kinds of layer slot included."""
    model = tiny_model("llama")
    ps = prompts(seed=5)
    rep, samples = extract(tmp_path, model, ps, tp=1, convention="before", layers=[0, 2, 4], compile=True)
    # every captured step: one tap per slot from the compiled graph (warm-up forwards are not counted)
    assert rep.traced_calls and rep.traced_calls % 3 == 0, (
        f"taps of the compiled graph in captured steps: {rep.traced_calls}"
    )
    assert_matches_reference(tmp_path, model, ps, rep, samples, [0, 2, 4], "before")


@NEWEST
def test_transformers_backend_matches_transformers(tmp_path, tiny_model):
    """vLLM's Transformers modeling backend (`model_impl="transformers"`; what vLLM 0.32 runs OLMo-2 and every other
    architecture without an implementation of its own on) calls HF's decoder layers, whose tensors are
    [1, tokens, hidden] and whose output is the residual stream itself: the capture still equals transformers, for
    the embeddings (id 0, layer 0's input) and layer outputs (ids 2 and 4)."""
    model = tiny_model("llama")
    ps = prompts(seed=7)
    layers = [0, 2, 4]
    rep, samples = extract(
        tmp_path, model, ps, tp=1, convention="before", layers=layers, llm_kwargs={"model_impl": "transformers"}
    )
    assert_matches_reference(tmp_path, model, ps, rep, samples, layers, "before")
