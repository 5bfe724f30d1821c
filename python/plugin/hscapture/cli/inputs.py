"""Inputs of an extraction: prompts and the model's configuration, checked before vLLM starts."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError


def read_prompts(path: str | Path) -> list[list[int]]:
    """JSONL, one ``{"token_ids": [...]}`` per line; blank lines are skipped, anything else is refused."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"input file {path} does not exist; expected JSONL with one {{\"token_ids\": [...]}} per line")
    prompts: list[list[int]] = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n}: not valid JSON ({e.msg}); expected {{\"token_ids\": [...]}}") from None
            ids = obj.get("token_ids") if isinstance(obj, dict) else None
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise ConfigError(f"{path}:{n}: expected an object with \"token_ids\": a list of non-negative integers")
            if not ids:
                raise ConfigError(f"{path}:{n}: the prompt is empty; every prompt needs at least one token")
            prompts.append(ids)
    if not prompts:
        raise ConfigError(f"input file {path} holds no prompts")
    return prompts


def read_model_config(model: str | Path) -> dict:
    p = Path(model) / "config.json"
    if not p.is_file():
        raise ConfigError(f"{p} not found: --model must be a local model directory with a config.json")
    return json.loads(p.read_text())


def text_config(cfg: dict) -> dict:
    return cfg.get("text_config") or cfg


def has_tokenizer(model: str | Path) -> bool:
    d = Path(model)
    return any((d / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


def check_prompts(prompts: list[list[int]], cfg: dict) -> None:
    text = text_config(cfg)
    vocab = text.get("vocab_size")
    max_pos = text.get("max_position_embeddings")
    for i, ids in enumerate(prompts):
        if vocab is not None and max(ids) >= vocab:
            raise ConfigError(f"prompt {i}: token id {max(ids)} is outside the model's vocabulary (vocab_size={vocab})")
        if max_pos is not None and len(ids) >= max_pos:
            raise ConfigError(
                f"prompt {i} has {len(ids)} tokens; the model accepts fewer than {max_pos} (max_position_embeddings): "
                "shorten or drop it"
            )
