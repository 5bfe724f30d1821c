"""Layer ids and conventions, through the Rust core."""

import pytest

from hscapture import ConfigError, _native


def test_after_and_before_ranges():
    assert _native.validate_layers([3, 0, 1], "after", 4) == [0, 1, 3]
    assert _native.validate_layers([4, 0], "before", 4) == [0, 4]
    with pytest.raises(ConfigError, match=r"valid ids are 0..=3.*`before` convention"):
        _native.validate_layers([4], "after", 4)
    with pytest.raises(ConfigError, match=r"valid ids are 0..=4"):
        _native.validate_layers([5], "before", 4)


@pytest.mark.parametrize("ids,match", [([], "empty"), ([1, 1], "twice"), ([-1], "negative")])
def test_refused_lists(ids, match):
    for conv in ("after", "before"):
        with pytest.raises(ConfigError, match=match):
            _native.validate_layers(ids, conv, 8)


def test_unknown_convention_is_explained():
    with pytest.raises(ConfigError, match=r'"after".*"before"'):
        _native.validate_layers([1], "output", 8)


def test_capture_points_are_one_apart():
    assert _native.capture_points([0, 4], "before", 4) == [("embeddings", 0), ("layer_output", 3)]
    for i in range(4):
        assert _native.capture_points([i], "after", 4) == _native.capture_points([i + 1], "before", 4)


def test_defaults():
    assert _native.default_layers("after", 32) == [2, 16, 29, 31]
    assert _native.default_layers("before", 32) == [2, 16, 29, 32]


def test_a_rust_panic_is_a_typed_error_not_a_base_exception():
    from hscapture import HscaptureError

    with pytest.raises(HscaptureError, match="internal error in _panic_for_test: boom; this is a bug"):
        _native._panic_for_test("boom")
