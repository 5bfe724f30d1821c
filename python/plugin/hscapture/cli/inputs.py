"""Inputs of an extraction: prompts and the model's configuration, checked before vLLM starts.

Prompts come as a :class:`PromptSet` (row ``i`` -> token ids, and a loss mask when the input has one), read
from JSONL (``token_ids``, or ``text`` plus a tokenizer) or from speculators' prepared dataset (an HF Arrow
directory, :mod:`.arrow`). Row ``i`` is sample ``i``: it names the file ``hs_{i}`` whatever shard runs it.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from pathlib import Path

from .. import _native
from ..errors import ConfigError

JSONL_HINT = 'expected JSONL with one {"token_ids": [...]} or {"text": "..."} per line'


class PromptSet:
    """Token ids by global row, stored flat (8 bytes a token, not a Python list per prompt)."""

    kind = "list"

    def __init__(
        self,
        flat: array,
        offsets: array,
        masks: dict[int, list[int]] | None = None,
        source: str = "prompts",
        lines: array | None = None,
    ):
        self._flat, self._off, self._masks, self.source = flat, offsets, masks or {}, source
        self._lines = lines  # the input line of each row (JSONL), for messages

    @classmethod
    def from_lists(cls, prompts: Sequence[Sequence[int]], source: str = "prompts") -> PromptSet:
        flat, off = array("q"), array("q", [0])
        for p in prompts:
            flat.extend(p)
            off.append(len(flat))
        return cls(flat, off, source=source)

    def __len__(self) -> int:
        return len(self._off) - 1

    def __getitem__(self, i: int) -> list[int]:
        return self._flat[self._off[i] : self._off[i + 1]].tolist()

    def length(self, i: int) -> int:
        return self._off[i + 1] - self._off[i]

    def where(self, i: int) -> str:
        """How row ``i`` is named in messages: ``prompt 3 (line 5 of in.jsonl)``."""
        if self._lines is not None and i < len(self._lines):
            return f"prompt {i} (line {self._lines[i]} of {self.source})"
        return f"prompt {i}"

    def loss_mask(self, i: int) -> list[int] | None:
        """The row's loss mask, or None when the input has none (legacy output then trains on every token)."""
        return self._masks.get(i)

    def max_token(self) -> int:
        import numpy as np

        return int(np.frombuffer(self._flat, dtype=np.int64).max()) if len(self._flat) else 0

    def fingerprint(self) -> str:
        """xxh3 of every row's token ids and boundaries: shards of one input agree on it."""
        return _native.checksum(self._flat.tobytes() + b"|" + self._off.tobytes())


def as_prompt_set(prompts) -> PromptSet:
    """``ExtractOptions.prompts`` may be a list of token-id lists (library use) or a prompt set."""
    if hasattr(prompts, "length") and hasattr(prompts, "fingerprint"):
        return prompts
    return PromptSet.from_lists(prompts)


def input_kind(path: str | Path) -> str:
    """``arrow`` for a directory written by ``datasets``' ``save_to_disk``, ``jsonl`` for a ``.jsonl`` file."""
    p = Path(path)
    if p.is_dir():
        if (p / "dataset_info.json").exists() or (p / "state.json").exists():
            return "arrow"
        if (p / "dataset_dict.json").exists():
            splits = sorted(x.name for x in p.iterdir() if x.is_dir())
            raise ConfigError(
                f"{p} is a dataset with splits {splits}, not one dataset: pass one split's directory, "
                f"e.g. --input {p / (splits[0] if splits else 'train')}"
            )
        raise ConfigError(
            f"{p} is a directory without dataset_info.json or state.json: expected speculators' prepared "
            "dataset (saved with datasets' save_to_disk) or a .jsonl file"
        )
    if not p.exists():
        raise ConfigError(f"input {p} does not exist; {JSONL_HINT}, or a prepared dataset directory (save_to_disk)")
    if p.suffix == ".jsonl":
        return "jsonl"
    raise ConfigError(
        f"input {p} is neither a .jsonl file nor a dataset directory; {JSONL_HINT} (name it *.jsonl), "
        "or pass speculators' prepared dataset directory"
    )


def open_input(
    path: str | Path, model: str | Path, tokenizer: str | None = None, trust_remote_code: bool = False
) -> PromptSet:
    """Reads ``--input``, its kind detected from the path."""
    if input_kind(path) == "arrow":
        from .arrow import ArrowPrompts

        return ArrowPrompts.open(path)
    return read_jsonl(path, lambda: load_tokenizer(model, tokenizer, trust_remote_code))


def read_prompts(path: str | Path, model: str | Path | None = None, tokenizer: str | None = None) -> list[list[int]]:
    """JSONL prompts as lists (blank lines skipped, anything else refused); ``text`` lines need a tokenizer."""
    ps = read_jsonl(path, lambda: load_tokenizer(model, tokenizer))
    return [ps[i] for i in range(len(ps))]


def read_jsonl(path: str | Path, get_tokenizer) -> PromptSet:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"input file {path} does not exist; {JSONL_HINT}")
    flat, off, masks, lines, tok = array("q"), array("q", [0]), {}, array("q"), None
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{path}:{n}"  # file:line; messages about a prompt name it with its line (PromptSet.where)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(
                    f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); {JSONL_HINT}"
                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not valid JSON ({e.msg}); {JSONL_HINT}") from None
            if not isinstance(obj, dict):
                raise ConfigError(
                    f'{where}: expected an object with "token_ids" (a list of non-negative integers) or "text"'
                )
            if "token_ids" in obj and "text" in obj:
                raise ConfigError(
                    f'{where}: the line has both "token_ids" and "text"; expected one of them (which one '
                    "is the prompt would be a guess)"
                )
            ids = obj.get("token_ids")
            if ids is None and isinstance(obj.get("text"), str):
                if tok is None:
                    try:
                        tok = get_tokenizer()
                    except ConfigError as e:
                        raise ConfigError(f"{where}: {e}") from None
                try:
                    ids = tok(obj["text"])
                except Exception as e:  # noqa: BLE001 - tokenizers raise many kinds (a lone surrogate: UnicodeEncodeError)
                    raise ConfigError(
                        f'{where}: the tokenizer cannot encode this "text" ({type(e).__name__}: {e}); '
                        "fix the text (a lone surrogate such as \\ud800?) or give token_ids"
                    ) from None
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
            ):
                raise ConfigError(
                    f'{where}: expected an object with "token_ids": a list of non-negative integers (or "text")'
                )
            if not ids:
                raise ConfigError(f"{where}: the prompt is empty; every prompt needs at least one token")
            if "loss_mask" in obj:
                m = obj["loss_mask"]
                if not isinstance(m, list) or len(m) != len(ids) or any(x not in (0, 1) for x in m):
                    raise ConfigError(
                        f'{where}: "loss_mask" must be a list of 0/1 as long as the prompt ({len(ids)} tokens); found '
                        f"{str(m)[:60]}"
                    )
                masks[len(off) - 1] = m
            try:
                flat.extend(ids)
            except OverflowError:
                raise ConfigError(
                    f"{where}: token id {max(ids)} does not fit a signed 64-bit integer; no vocabulary "
                    "is that large: the line is damaged"
                ) from None
            off.append(len(flat))
            lines.append(n)
    if len(off) == 1:
        raise ConfigError(f"input file {path} holds no prompts")
    return PromptSet(flat, off, masks, source=str(path), lines=lines)


def load_tokenizer(model: str | Path | None, tokenizer: str | None, trust_remote_code: bool = False):
    """A callable text -> token ids: ``--tokenizer PATH``, else the model directory's tokenizer (its own code
    run only with ``--trust-remote-code``)."""
    where = tokenizer or model
    fix = 'pass --tokenizer PATH (a tokenizer directory), or give "token_ids" instead of "text"'
    if where is None:
        raise ConfigError(f'the input has "text" prompts but no tokenizer was given; {fix}')
    if tokenizer is None and not has_tokenizer(where):
        raise ConfigError(
            f'the input has "text" prompts but the model directory {where} has no tokenizer files '
            f"(tokenizer.json, tokenizer.model, tokenizer_config.json); {fix}"
        )
    try:
        from transformers import AutoTokenizer

        t = AutoTokenizer.from_pretrained(str(where), trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, ... for an unusable directory
        remote = "" if trust_remote_code else " (a tokenizer with its own code needs --trust-remote-code)"
        raise ConfigError(
            f"cannot load a tokenizer from {where}: {type(e).__name__}: {e}; pass --tokenizer with a "
            f"directory that AutoTokenizer.from_pretrained reads{remote}"
        ) from None
    return lambda text: list(t(text)["input_ids"])


def read_model_config(model: str | Path) -> dict:
    p = Path(model) / "config.json"
    if not p.is_file():
        raise ConfigError(f"{p} not found: --model must be a local model directory with a config.json")
    try:
        cfg = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"{p} is not valid JSON ({e}); expected the model's config.json as transformers saves it"
        ) from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p} holds {type(cfg).__name__}; expected a JSON object (the model's config)")
    return cfg


def text_config(cfg: dict) -> dict:
    """The language model's part of a config (multimodal configs keep it under ``text_config``)."""
    text = cfg.get("text_config")
    return text if isinstance(text, dict) else cfg


# The names transformers' configs use for the fields the driver checks (GPT-2 writes n_layer, n_embd, ...).
_ALIASES = {
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"),
    "vocab_size": ("vocab_size",),
}


# Hybrid decoders may give their depth only as one entry per layer: NemotronH's `layers_block_type` (transformers
# 5 writes no num_hidden_layers) and `hybrid_override_pattern` (a character per layer), Granite 4's `layer_types`.
_PER_LAYER = ("layers_block_type", "hybrid_override_pattern", "layer_types")


def model_field(cfg: dict, name: str, required: bool = True) -> int | None:
    """A field of the model's (text) config by any of its names; a required one missing is a ``ConfigError``."""
    text = text_config(cfg)
    for key in _ALIASES[name]:
        v = text.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    if name == "num_hidden_layers":
        for key in _PER_LAYER:
            v = text.get(key)
            if isinstance(v, (list, str)) and len(v) > 0:
                return len(v)
    if required:
        also = f", {', '.join(_PER_LAYER)} (one entry per layer)" if name == "num_hidden_layers" else ""
        raise ConfigError(
            f"the model's config.json has no {name} (looked for {', '.join(_ALIASES[name])}{also}, also under "
            "text_config); expected a transformers config of a decoder model"
        )
    return None


def has_tokenizer(model: str | Path) -> bool:
    d = Path(model)
    return any((d / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


def check_prompts(prompts, cfg: dict, rows: Sequence[int] | None = None, max_model_len: int | None = None) -> None:
    """Token ids inside the vocabulary, prompts shorter than ``max_position_embeddings`` and than
    ``max_model_len`` (a prompt and its one generated token must fit), for the rows this run captures."""
    ps = as_prompt_set(prompts)
    where = getattr(ps, "where", lambda i: f"prompt {i}")
    vocab = model_field(cfg, "vocab_size", required=False)
    max_pos = model_field(cfg, "max_position_embeddings", required=False)
    if vocab is not None and ps.max_token() >= vocab:
        i = next(i for i in range(len(ps)) if max(ps[i]) >= vocab)
        raise ConfigError(f"{where(i)}: token id {max(ps[i])} is outside the model's vocabulary (vocab_size={vocab})")
    for i in rows if rows is not None else range(len(ps)):
        if max_pos is not None and ps.length(i) >= max_pos:
            raise ConfigError(
                f"{where(i)} has {ps.length(i)} tokens; the model accepts fewer than {max_pos} (max_position_embeddings): "
                "shorten or drop it"
            )
        if max_model_len is not None and ps.length(i) >= max_model_len:
            raise ConfigError(
                f"{where(i)} has {ps.length(i)} tokens; --max-model-len {max_model_len} accepts prompts of at most "
                f"{max_model_len - 1} (the prompt and the one token generated): raise --max-model-len or shorten it"
            )
