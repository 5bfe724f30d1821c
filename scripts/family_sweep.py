"""Decoder families against HF on vLLM for CPU: for each, a tiny random float32 model built from its transformers
config, captured by `hscapture extract` (32-token steps, so prefill is chunked) and compared token by token with
transformers' own forward (relative error <= 1e-3). What docs/compatibility.md's sweep rows were run with.

    .venv-newest/bin/python scripts/family_sweep.py [--families qwen3,exaone4,...] [--convention after]
                                                    [--compiled] [--dir /tmp/family-sweep]

One line per family: OK / MISMATCH (worst relative error and where: sample, token, slot) / ERROR (vLLM could not load
or run the model: check it without hscapture before blaming the capture). Slow: ~25 s a family on 2 cores."""

from __future__ import annotations

import argparse
import random
import time
import traceback
from pathlib import Path

# family: (transformers config class, what differs from tiny.dense())
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "mistral": ("MistralConfig", {}),
    "gemma2": (
        "Gemma2Config",
        dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=16, tie_word_embeddings=True),
    ),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=16)),
    "phi3": ("Phi3Config", {}),
    "olmo2": ("Olmo2Config", {}),
    "granite": (
        "GraniteConfig",
        dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0),
    ),
    "glm4": ("Glm4Config", dict(head_dim=32, partial_rotary_factor=0.5)),
    "starcoder2": ("Starcoder2Config", {}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1),
    ),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2)),
    "gpt_oss": ("GptOssConfig", dict(head_dim=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=16)),
    "flex_olmo": ("FlexOlmoConfig", dict(num_experts=8, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=128),
    ),
    "granitemoe": ("GraniteMoeConfig", dict(num_local_experts=8, num_experts_per_tok=2)),
    "nemotron": ("NemotronConfig", dict(partial_rotary_factor=0.5)),
    "gpt2": ("GPT2Config", dict(n_embd=128, n_layer=4, n_head=4, n_positions=2048)),
    "opt": ("OPTConfig", dict(ffn_dim=256, word_embed_proj_dim=128, do_layer_norm_before=True)),
    "falcon": ("FalconConfig", dict(new_decoder_architecture=True, num_kv_heads=2, parallel_attn=True)),
    "gptj": ("GPTJConfig", dict(n_embd=128, n_layer=4, n_head=4, rotary_dim=16, n_positions=2048)),
    "phi": ("PhiConfig", dict(partial_rotary_factor=0.5)),
    # layers that return the residual stream whole beside a stale intermediate (adapters/layer_output.py)
    "cohere": ("CohereConfig", {}),
    "cohere2": ("Cohere2Config", dict(sliding_window=16)),
    "exaone4": ("Exaone4Config", dict(sliding_window=16)),
    "stablelm": ("StableLmConfig", {}),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        dict(num_local_experts=8, num_experts_per_tok=2, layer_types=["attention"] * 4),
    ),
    # newer dense and MoE decoders (vLLM 0.32, transformers 5.x)
    "smollm3": ("SmolLM3Config", dict(no_rope_layer_interval=2)),
    "olmo3": ("Olmo3Config", dict(sliding_window=16)),
    "seed_oss": ("SeedOssConfig", dict(head_dim=32)),
    "arcee": ("ArceeConfig", {}),
    "glm": ("GlmConfig", dict(head_dim=32)),
    "vaultgemma": ("VaultGemmaConfig", dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=16)),
    "apertus": ("ApertusConfig", {}),
    "ernie4_5": ("Ernie4_5Config", dict(head_dim=32)),
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        dict(head_dim=32, moe_num_experts=8, moe_k=2, moe_intermediate_size=64, moe_layer_start_index=1),
    ),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", dict(head_dim=32)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", dict(head_dim=32, num_experts=8, moe_topk=2)),
    "granitemoeshared": (
        "GraniteMoeSharedConfig",
        dict(num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=128),
    ),
    "dbrx": (
        "DbrxConfig",
        dict(
            d_model=128,
            n_heads=4,
            n_layers=4,
            max_seq_len=2048,
            attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
            ffn_config=dict(ffn_hidden_size=256, moe_num_experts=4, moe_top_k=2),
        ),
    ),
    "llama4_text": (
        "Llama4TextConfig",
        dict(head_dim=32, num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2),
    ),
    "gemma3n_text": (
        "Gemma3nTextConfig",
        dict(
            head_dim=32,
            sliding_window=16,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            activation_sparsity_pattern=[0.0] * 4,
            num_kv_shared_layers=0,
            tie_word_embeddings=True,
        ),
    ),
    "ministral3": ("Ministral3Config", dict(head_dim=32)),
    "qwen3_5_text": ("Qwen3_5TextConfig", dict(head_dim=32)),
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64),
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        dict(head_dim=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1),
    ),
    "afmoe": (  # score_func, route_norm: read by vLLM 0.32, absent from transformers 5's config
        "AfmoeConfig",
        dict(
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            score_func="sigmoid",
            route_norm=True,
            n_group=1,
            topk_group=1,
        ),
    ),
    "minimax_m2": (
        "MiniMaxM2Config",
        dict(
            head_dim=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            rotary_dim=16,
            scoring_func="softmax",
            use_routing_bias=True,
        ),
    ),
    "lfm2": ("Lfm2Config", dict(block_dim=128, block_ff_dim=256)),
    "falcon_h1": ("FalconH1Config", dict(head_dim=32)),
    "jamba": (
        "JambaConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
        ),
    ),
    "nemotron_h": ("NemotronHConfig", {}),
    "zamba2": ("Zamba2Config", dict(layers_block_type=["mamba", "hybrid", "mamba", "hybrid"])),
}


# Parameters left at transformers' initial values: where vLLM's model and transformers' differ with them random, a
# difference that is not the capture's. Ernie 4.5 MoE: with a nonzero expert-selection bias (`e_score_correction_bias`,
# softmax scoring) vLLM 0.32 on CPU picks other experts than transformers 5 (log-probabilities 0.2 apart without
# hscapture; equal to 1e-6 with the bias zero).
KEEP_INIT = {"ernie4_5_moe": ("e_score_correction_bias",)}


def build(family: str, path: Path) -> Path:
    """The family's tiny model at ``path`` (reused if there), weights ~N(0, 0.05) so that every layer moves the
    stream visibly."""
    import torch
    import transformers as tf

    from hscapture.testing import tiny

    if (path / "config.json").exists():
        return path
    cls, extra = FAMILIES[family]
    cfg = getattr(tf, cls)(**{**tiny.dense(), **extra})
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not any(k in name for k in KEEP_INIT.get(family, ())):
                p.normal_(0, 0.05)
    model.save_pretrained(str(path))
    tiny._save_tokenizer(path)
    return path


def check(family: str, root: Path, convention: str, compiled: bool) -> str:
    from hscapture import load_sample
    from hscapture.cli.extract import ExtractOptions, run_extract
    from hscapture.testing import reference
    from hscapture.testing.compare import compare

    model = str(build(family, root / "models" / family))
    rng = random.Random(1)
    prompts = [[rng.randrange(4, 1024) for _ in range(n)] for n in (5, 40, 77, 12, 64, 1)]
    work = root / f"{family}-{convention}-{'compiled' if compiled else 'eager'}-{time.time_ns()}"
    opts = ExtractOptions(
        model=model,
        prompts=prompts,
        out=str(work / "out"),
        convention=convention,
        layers=[0, 1, 3],
        dtype="float32",
        max_num_batched_tokens=32,
        progress=False,
        durable=False,
        compile=compiled,
    )
    rep = run_extract(opts)
    got = [load_sample(work / "out" / "hidden_states" / f"hs_{i}.safetensors") for i in range(len(prompts))]
    ref = reference.compute_subprocess(model, prompts, list(rep.layer_ids), convention, work / "ref")
    c = compare([s["hidden_states"] for s in got], ref)
    return f"{'OK' if c.ok(1e-3) else 'MISMATCH'} worst {c.worst:.2e} at {c.where}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--convention", default="after", choices=["after", "before"])
    ap.add_argument("--compiled", action="store_true", help="vLLM's torch.compile on (default: eager)")
    ap.add_argument("--dir", default="/tmp/family-sweep")
    a = ap.parse_args()
    root = Path(a.dir)
    for family in a.families.split(","):
        t = time.time()
        try:
            verdict = check(family, root, a.convention, a.compiled)
        except Exception as e:  # noqa: BLE001 - one family's failure is that family's line
            traceback.print_exc()
            verdict = f"ERROR {type(e).__name__}: {str(e)[:300]}"
        mode = "compiled" if a.compiled else "eager"
        print(f"SWEEP {family} ({a.convention}, {mode}): {verdict} ({time.time() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
