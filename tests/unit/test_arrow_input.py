"""speculators' prepared dataset (datasets' save_to_disk) as extract's input: row i is sample i."""

import pytest

datasets = pytest.importorskip("datasets", reason="the prepared-dataset input needs `datasets` (scripts/setup.sh)")

from hscapture import ConfigError  # noqa: E402
from hscapture.cli.inputs import PromptSet, check_prompts, input_kind, open_input  # noqa: E402

ROWS = [[5, 6, 7], [8], [9, 10, 11, 12]]


def save(tmp_path, name="ds", fmt=None, **cols):
    data = {"input_ids": ROWS, "loss_mask": [[0, 1, 1], [1], [0, 0, 1, 1]], "seq_len": [len(r) for r in ROWS]}
    data.update(cols)
    data = {k: v for k, v in data.items() if v is not None}
    d = tmp_path / name
    ds = datasets.Dataset.from_dict(data)
    if fmt:
        ds.set_format(type=fmt)
    ds.save_to_disk(str(d))
    return d


@pytest.mark.parametrize("fmt", [None, "torch"])  # speculators' prepare_data saves with the torch format
def test_rows_masks_and_lengths(tmp_path, fmt):
    d = save(tmp_path, fmt=fmt)
    assert input_kind(d) == "arrow"
    ps = open_input(d, tmp_path)
    assert ps.kind == "arrow" and len(ps) == 3
    assert [ps[i] for i in range(3)] == ROWS and [ps.length(i) for i in range(3)] == [3, 1, 4]
    assert ps.loss_mask(2) == [0, 0, 1, 1] and ps.max_token() == 12
    assert ps.fingerprint() == open_input(save(tmp_path, "again"), tmp_path).fingerprint()
    assert ps.fingerprint() != PromptSet.from_lists(ROWS[::-1]).fingerprint()
    check_prompts(ps, {"vocab_size": 13, "max_position_embeddings": 5})
    with pytest.raises(ConfigError, match="prompt 2: token id 12 is outside the model's vocabulary"):
        check_prompts(ps, {"vocab_size": 12})


def test_without_loss_mask_every_token_counts(tmp_path):
    ps = open_input(save(tmp_path, loss_mask=None), tmp_path)
    assert ps.loss_mask(0) is None


@pytest.mark.parametrize(
    "cols,match",
    [
        ({"seq_len": [3, 2, 4]}, r"row 1 of .*: seq_len 2 but 1 input_ids"),
        ({"loss_mask": [[1, 1, 1], [1, 1], [1, 1, 1, 1]]}, r"row 1 of .*: 2 loss_mask values for 1 input_ids"),
        ({"input_ids": [[1], [], [2]], "seq_len": None, "loss_mask": None}, r"row 1 of .* has no input_ids"),
    ],
)
def test_inconsistent_datasets_are_refused(tmp_path, cols, match):
    with pytest.raises(ConfigError, match=match):
        open_input(save(tmp_path, **cols), tmp_path)


def test_a_dataset_without_input_ids_or_with_splits(tmp_path):
    d = tmp_path / "noids"
    datasets.Dataset.from_dict({"text": ["a"]}).save_to_disk(str(d))
    with pytest.raises(ConfigError, match=r"columns \['text'\]; expected an `input_ids` column"):
        open_input(d, tmp_path)
    dd = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": ROWS})}).save_to_disk(str(dd))
    with pytest.raises(ConfigError, match="splits"):
        open_input(dd, tmp_path)
    assert open_input(dd / "train", tmp_path)[1] == [8]
