"""Configuration from additional_config and HSCAPTURE_* variables."""

import re

import pytest

from hscapture import ConfigError, envs
from hscapture.config import from_sources


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in list(__import__("os").environ):
        if k.startswith("HSCAPTURE_"):
            monkeypatch.delenv(k)


def test_nothing_configured_means_no_capture():
    assert from_sources({}) is None
    assert from_sources(None) is None


def test_additional_config_section():
    c = from_sources({"hscapture": {"layers": [1, 2], "convention": "before", "out": "/x", "dtype": "bf16"}})
    assert (c.layers, c.convention, c.out, c.dtype) == ((1, 2), "before", "/x", "bfloat16")
    assert c.resolve(4) == [1, 2]
    with pytest.raises(
        ConfigError, match=r"layers=\[2, 1\] is not valid; expected a non-empty list of integer layer ids in ascending"
    ):
        from_sources({"hscapture": {"layers": [2, 1], "convention": "before", "out": "/x"}})


@pytest.mark.parametrize(
    "key,value,expect",
    [
        ("layers", [1.5], "a non-empty list of integer layer ids"),
        ("layers", "1_0", "a non-empty list of integer layer ids"),
        ("layers", [True], "a non-empty list of integer layer ids"),
        ("dtype", "int8", "auto, float32, bfloat16 or float16"),
        ("compress", 1.7, "an integer: 0"),
        ("compress", True, "an integer: 0"),
        ("durable", "ture", "true or false"),
        ("durable", 2, "true or false"),
        ("writer_threads", "1_0", "a positive integer"),
        ("out", None, "the output directory, a non-empty path"),
        ("out", "", "the output directory, a non-empty path"),
        ("out", 7, "the output directory, a non-empty path"),
        ("convention", 1, '"after" or "before"'),
    ],
)
def test_every_value_is_checked_for_its_type(key, value, expect):
    """No truthiness of strings, no float truncation, no None written as a directory named None."""
    section = {"layers": [1], "convention": "after", "out": "/x", key: value}
    with pytest.raises(ConfigError, match=rf"{key}=.* is not valid; expected {re.escape(expect)}"):
        from_sources({"hscapture": section})


def test_text_values_read_as_their_kind():
    c = from_sources(
        {"hscapture": {"layers": "1, 3", "convention": "AFTER", "out": "/x", "durable": "Off", "compress": "3"}}
    )
    assert (c.layers, c.convention, c.durable, c.compress) == ((1, 3), "after", False, 3)


def test_environment(monkeypatch):
    monkeypatch.setenv("HSCAPTURE_LAYERS", "1,3")
    monkeypatch.setenv("HSCAPTURE_CONVENTION", "after")
    monkeypatch.setenv("HSCAPTURE_DURABLE", "0")
    c = from_sources({})
    assert (c.layers, c.convention, c.durable) == ((1, 3), "after", False)
    assert c.sources["layers"] == "HSCAPTURE_LAYERS"


def test_same_setting_twice_must_agree(monkeypatch):
    monkeypatch.setenv("HSCAPTURE_LAYERS", "1,3")
    assert from_sources({"hscapture": {"layers": [1, 3], "convention": "after"}}).layers == (1, 3)
    with pytest.raises(ConfigError, match=r"given twice with different values.*\(1, 2\).*HSCAPTURE_LAYERS"):
        from_sources({"hscapture": {"layers": [1, 2], "convention": "after"}})


def test_layers_need_a_convention():
    with pytest.raises(ConfigError, match="without a convention"):
        from_sources({"hscapture": {"layers": [1]}})


def test_bad_values_and_keys():
    with pytest.raises(ConfigError, match="unknown keys"):
        from_sources({"hscapture": {"layer": [1], "convention": "after"}})
    with pytest.raises(ConfigError, match="list of integer layer ids"):
        from_sources({"hscapture": {"layers": "a,b", "convention": "after"}})
    with pytest.raises(ConfigError, match='"after" or "before"'):
        from_sources({"hscapture": {"layers": [1], "convention": "output"}})
    with pytest.raises(ConfigError, match="no layer ids"):
        from_sources({"hscapture": {"out": "/tmp/x"}})


def test_unknown_variable_warns_with_close_match(monkeypatch):
    monkeypatch.setenv("HSCAPTURE_LAYRES", "1")
    with pytest.warns(UserWarning, match="did you mean HSCAPTURE_LAYERS"):
        msgs = envs.check_unknown()
    assert len(msgs) == 1


def test_docs_follow_the_registry():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    assert (root / "docs" / "configuration.md").read_text() == envs.markdown(), "run `make docs`"


def test_on_nonfinite_is_error_by_default_and_skip_on_request(monkeypatch):
    from hscapture.config import from_sources

    base = {"layers": [1], "convention": "after"}
    assert from_sources({"hscapture": base}).on_nonfinite == "error"
    assert from_sources({"hscapture": {**base, "on_nonfinite": "SKIP"}}).on_nonfinite == "skip"
    monkeypatch.setenv("HSCAPTURE_ON_NONFINITE", "skip")
    assert from_sources({"hscapture": base}).on_nonfinite == "skip"
    monkeypatch.delenv("HSCAPTURE_ON_NONFINITE")
    with pytest.raises(ConfigError, match="on_nonfinite='drop' is not valid; expected \"error\""):
        from_sources({"hscapture": {**base, "on_nonfinite": "drop"}})


def test_writer_threads_default_to_one_per_core_within_4_to_16(monkeypatch):
    import os

    base = {"layers": [1], "convention": "after"}
    for cores, want in [(2, 4), (8, 8), (16, 16), (128, 16)]:
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, c=cores: set(range(c)), raising=False)
        assert from_sources({"hscapture": base}).writer_threads == want, cores
        assert from_sources({"hscapture": {**base, "writer_threads": "auto"}}).writer_threads == want
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert from_sources({"hscapture": base}).writer_threads == 4
    monkeypatch.setenv("HSCAPTURE_WRITER_THREADS", "3")
    assert from_sources({"hscapture": base}).writer_threads == 3
    monkeypatch.setenv("HSCAPTURE_WRITER_THREADS", "many")
    with pytest.raises(
        ConfigError,
        match=r'HSCAPTURE_WRITER_THREADS: writer_threads=.many. is not valid; expected a positive integer or "auto"',
    ):
        from_sources({"hscapture": base})
