"""speculators' prepared dataset as input: an HF Arrow directory written by ``datasets``' ``save_to_disk``
with ``input_ids`` (int64 [L]), ``loss_mask`` and ``seq_len``.

Row ``i`` of the dataset is sample ``i``: its states go to ``hs_{i}.safetensors`` with ``token_ids`` equal to
the row's ``input_ids``, which is what speculators' training reads (``<data_path>/hidden_states/hs_{i}``).
The dataset stays memory-mapped; rows are read when their request is sent.
"""

from __future__ import annotations

from pathlib import Path

from .. import _native
from ..errors import ConfigError


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            "reading a prepared dataset needs the `datasets` package, which is not installed in this environment; "
            "install it (pip install datasets) or pass a .jsonl input"
        ) from None
    return datasets


class ArrowPrompts:
    """A :class:`~.inputs.PromptSet` over a ``save_to_disk`` directory."""

    kind = "arrow"

    def __init__(self, ds, source: str) -> None:
        self._ds = ds
        self.source = source
        self._lengths: list[int] | None = None
        self._has_mask = "loss_mask" in ds.column_names

    @classmethod
    def open(cls, path: str | Path) -> ArrowPrompts:
        datasets = _datasets()
        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as e:  # noqa: BLE001 - datasets raises FileNotFoundError, ValueError, ... for a broken directory
            raise ConfigError(
                f"cannot load the prepared dataset {path}: {type(e).__name__}: {e}; expected a directory "
                "written by datasets' save_to_disk"
            ) from None
        if isinstance(ds, datasets.DatasetDict):
            raise ConfigError(f"{path} holds splits {list(ds)}, not one dataset: pass one split's directory")
        if "input_ids" not in ds.column_names:
            raise ConfigError(
                f"the prepared dataset {path} has columns {ds.column_names}; expected an `input_ids` "
                "column (speculators' prepare_data output)"
            )
        if len(ds) == 0:
            raise ConfigError(f"the prepared dataset {path} has no rows")
        self = cls(
            ds.with_format("numpy", columns=[c for c in ("input_ids", "loss_mask") if c in ds.column_names]), str(path)
        )
        self._raw = ds
        self._check_seq_len()
        return self

    def _column(self, name: str):
        """The whole column as one pyarrow array (zero-copy where the table is memory-mapped)."""
        return self._raw.with_format("arrow")[:][name]

    def _check_seq_len(self) -> None:
        import pyarrow.compute as pc

        ids = self._column("input_ids")
        lengths = pc.list_value_length(ids).to_pylist()
        if min(lengths) == 0:
            raise ConfigError(
                f"row {lengths.index(0)} of {self.source} has no input_ids; every prompt needs at least "
                "one token: drop the row or re-run speculators' preparation"
            )
        mn = pc.min(pc.list_flatten(ids)).as_py()
        if mn is not None and mn < 0:
            raise ConfigError(f"{self.source} holds a negative token id ({mn}); expected vocabulary indices")
        if "seq_len" in self._raw.column_names:
            declared = self._column("seq_len").to_pylist()
            bad = next((i for i, (a, b) in enumerate(zip(lengths, declared, strict=True)) if a != b), None)
            if bad is not None:
                raise ConfigError(
                    f"row {bad} of {self.source}: seq_len {declared[bad]} but {lengths[bad]} input_ids; "
                    "the dataset is inconsistent: re-run speculators' preparation"
                )
        if self._has_mask:
            ml = pc.list_value_length(self._column("loss_mask")).to_pylist()
            bad = next((i for i, (a, b) in enumerate(zip(lengths, ml, strict=True)) if a != b), None)
            if bad is not None:
                raise ConfigError(
                    f"row {bad} of {self.source}: {ml[bad]} loss_mask values for {lengths[bad]} input_ids; "
                    "the dataset is inconsistent: re-run speculators' preparation"
                )
        self._lengths = lengths

    def __len__(self) -> int:
        return len(self._ds)

    def __getitem__(self, i: int) -> list[int]:
        return self._ds[int(i)]["input_ids"].tolist()

    def length(self, i: int) -> int:
        assert self._lengths is not None
        return self._lengths[i]

    def loss_mask(self, i: int) -> list[int] | None:
        return [int(x) for x in self._ds[int(i)]["loss_mask"].tolist()] if self._has_mask else None

    def max_token(self) -> int:
        import pyarrow.compute as pc

        return int(pc.max(pc.list_flatten(self._column("input_ids"))).as_py())

    def fingerprint(self) -> str:
        """xxh3 over the token ids and row boundaries, chunk by chunk (reads the column once)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        ids = self._column("input_ids")
        chunks = ids.chunks if isinstance(ids, pa.ChunkedArray) else [ids]
        parts = []
        for c in chunks:
            c = c.cast(pa.list_(pa.int64()))
            parts.append(_native.checksum(c.flatten().to_numpy().tobytes()))
            parts.append(_native.checksum(pc.list_value_length(c).to_numpy().tobytes()))
        return _native.checksum("|".join(parts).encode())
