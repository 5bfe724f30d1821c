"""Tiny models built from transformers configs with fixed seeds (no model hub needed).

``demo`` uses ``deepseek_v3``: DeepSeek-V3-shaped (MLA attention dims of the real model, YaRN rope,
a dense first layer then MoE with a shared expert and sigmoid ``noaux_tc`` routing), random weights.
The tests also use ``llama``, ``deepseek_v2``, ``exaone4`` and ``stablelm`` (decoder layers that return the residual
stream whole) and ``qwen2_vl`` (Qwen2-VL, its vision tower as deep as the text model but narrower: the text model's
layers must be the ones hooked).
Models are saved with ``save_pretrained``; a WordLevel tokenizer is added so that text prompts work too (for
``qwen2_vl`` with Qwen2-VL's vision tokens after the vocabulary, and its image and video processors).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

VOCAB = 1024
VERSION = 2  # bump when a model's definition changes, so cached builds are replaced

YARN = {
    "type": "yarn",
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}


def dense() -> dict:
    """The shape the tiny dense decoders share (hidden 128, 4 layers, 4 heads over 2 KV heads), as config keys."""
    return dict(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )


def _deepseek_common() -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        max_position_embeddings=163840,
        rope_scaling=dict(YARN),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )


# Qwen2-VL's vision tokens, ids VOCAB, VOCAB + 1, ...: outside the ids the tests' prompts draw (4 to VOCAB - 1).
QWEN2_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def _qwen2_vl_config():
    import transformers as tf

    ids = {t: VOCAB + i for i, t in enumerate(QWEN2_VL_TOKENS)}
    text = dict(
        vocab_size=VOCAB + len(QWEN2_VL_TOKENS),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]},  # sums to head_dim / 2 = 32
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )
    # As deep as the text model, narrower (embed_dim 64); `hidden_size` is what its merger hands the text model.
    vision = dict(depth=text["num_hidden_layers"], embed_dim=64, hidden_size=128, num_heads=2, mlp_ratio=2)
    return tf.Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        tie_word_embeddings=False,
    )


def _save_tokenizer(path: Path, specials: tuple[str, ...] = ()) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
    vocab.update({t: VOCAB + i for i, t in enumerate(specials)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    extra = {"additional_special_tokens": list(specials)} if specials else {}
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>", **extra
    ).save_pretrained(str(path))


def _save_qwen2_vl_processor(path: Path, vision) -> None:
    """The tokenizer with the vision tokens, and image/video processors of ``vision``'s patches (at most 56x56
    pixels: 4 image tokens, what vLLM's profiling runs through the tower)."""
    import transformers as tf

    _save_tokenizer(path, QWEN2_VL_TOKENS)
    if int(tf.__version__.split(".")[0]) < 5:
        # transformers 4.x's Qwen2VLProcessor takes only a Qwen2 tokenizer (5.x any); the fast one reads this
        # tokenizer.json unchanged.
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        cfg["tokenizer_class"] = "Qwen2Tokenizer"
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    kw = dict(
        min_pixels=28 * 28,
        max_pixels=56 * 56,
        patch_size=vision.patch_size,
        merge_size=vision.spatial_merge_size,
        temporal_patch_size=vision.temporal_patch_size,
    )
    tf.Qwen2VLProcessor(
        image_processor=tf.Qwen2VLImageProcessor(**kw),
        tokenizer=tf.AutoTokenizer.from_pretrained(str(path)),
        video_processor=tf.Qwen2VLVideoProcessor(**kw),
    ).save_pretrained(str(path))


def build(kind: str, path: str | Path, seed: int = 0, tokenizer: bool = True, dtype: str = "bfloat16") -> Path:
    """Builds tiny model ``kind`` (``llama``, ``deepseek_v2``, ``deepseek_v3``, ``exaone4``, ``stablelm``, ``qwen2_vl``)
    at ``path``, weights saved
    in ``dtype`` (what ``dtype="auto"`` loads); returns the path. Reuses an identical earlier build.
    """
    want = {"kind": kind, "seed": seed, "tokenizer": tokenizer, "version": VERSION, "dtype": dtype}
    return _cached(Path(path), want, lambda part: _build(kind, part, seed, tokenizer, dtype))


def draft(target: str | Path, path: str | Path, noise: float = 0.1, seed: int = 7) -> Path:
    """A draft model for speculative decoding at ``path``: tiny model ``target`` with Gaussian noise of ``noise`` times
    each weight matrix's standard deviation added (embeddings and head kept, so the vocabulary is the same). Its
    greedy tokens agree with the target's often but not always: at 0.1, about one draft token in five is accepted,
    so steps both keep and reject drafts. Reuses an identical earlier build."""
    target = Path(target)
    want = {"draft_of": json.loads((target / "hscapture_tiny.json").read_text()), "noise": noise, "seed": seed}
    return _cached(Path(path), want, lambda part: _build_draft(target, part, noise, seed))


def _cached(path: Path, want: dict, make) -> Path:
    if _built(path, want):
        return path
    # Test processes share the cache (the suites run side by side): one builds, under a lock, into a folder of its
    # own that is renamed into place whole; the others wait and reuse it.
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _built(path, want):
            return path
        part = path.parent / f".{path.name}.part-{os.getpid()}"
        shutil.rmtree(part, ignore_errors=True)
        make(part)
        (part / "hscapture_tiny.json").write_text(json.dumps(want))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(part, path)
    return path


def _build_draft(target: Path, path: Path, noise: float, seed: int) -> None:
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(target), torch_dtype="auto")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name and "lm_head" not in name:
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * p.float().std().to(p.dtype) * noise)
    model.save_pretrained(str(path))
    for f in target.iterdir():  # the tokenizer's files, as the target has them
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "vocab.json":
            shutil.copy2(f, path / f.name)


def _built(path: Path, want: dict) -> bool:
    stamp = path / "hscapture_tiny.json"
    return stamp.exists() and json.loads(stamp.read_text()) == want


def _build(kind: str, path: Path, seed: int, tokenizer: bool, dtype: str) -> None:
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "llama":
        cfg = tf.LlamaConfig(**dense(), head_dim=64)
        model = tf.LlamaForCausalLM(cfg)
        extra = {}
    elif kind == "deepseek_v2":
        cfg = tf.DeepseekV2Config(**_deepseek_common(), q_lora_rank=None, topk_method="greedy", norm_topk_prob=False)
        model = tf.DeepseekV2ForCausalLM(cfg)
        extra = {}
    elif kind == "deepseek_v3":
        cfg = tf.DeepseekV3Config(**_deepseek_common(), q_lora_rank=64, norm_topk_prob=True)
        model = tf.DeepseekV3ForCausalLM(cfg)
        # transformers does not write these; vLLM (like the real config.json) needs them.
        extra = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    elif kind in ("exaone4", "stablelm"):
        # Layers that return the residual stream whole, with a stale intermediate beside it (Exaone 4: taking a
        # residual argument it overwrites; StableLM: taking none): their output is hidden_states alone.
        if kind == "exaone4":
            cfg = tf.Exaone4Config(**dense(), sliding_window=16)
            model = tf.Exaone4ForCausalLM(cfg)
        else:
            cfg = tf.StableLmConfig(**dense())
            model = tf.StableLmForCausalLM(cfg)
        extra = {}
    elif kind == "qwen2_vl":
        cfg = _qwen2_vl_config()
        model = tf.Qwen2VLForConditionalGeneration(cfg)
        # transformers 4.x writes `architectures` into text_config only; vLLM reads it at the top, like real configs.
        extra = {"architectures": ["Qwen2VLForConditionalGeneration"]}
    else:
        raise ValueError(
            f"unknown tiny model {kind!r}; expected llama, deepseek_v2, deepseek_v3, exaone4, stablelm or qwen2_vl"
        )
    _randomize_buffers(model)
    model.to(getattr(torch, dtype)).save_pretrained(str(path))
    if extra:
        c = json.loads((path / "config.json").read_text())
        c.update(extra)
        (path / "config.json").write_text(json.dumps(c, indent=2))
    if tokenizer and kind == "qwen2_vl":
        _save_qwen2_vl_processor(path, cfg.vision_config)
    elif tokenizer:
        _save_tokenizer(path)


def _randomize_buffers(model) -> None:
    """Gives zero-initialised parameters (MoE correction bias) small random values so that a wrong
    routing would show in the states."""
    import itertools

    import torch

    for name, p in itertools.chain(model.named_parameters(), model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            with torch.no_grad():
                p.copy_(torch.rand_like(p) * 0.1)
