"""The KV connector's settings: read from kv_connector_extra_config, checked, merged with additional_config."""

from types import SimpleNamespace as NS

import pytest

from hscapture import ConfigError, _native
from hscapture.adapters import requested
from hscapture.config import from_sources


def vc(extra, name="HscaptureConnector"):
    return NS(kv_transfer_config=NS(kv_connector=name, kv_connector_extra_config=extra))


def test_the_issue_s_spelling_and_the_shorter_ones():
    assert requested.settings(vc({"shared_storage_path": "/d", "format": "file"})) == {
        "out": "/d",
        "format": "hscapture",
    }
    s = requested.settings(vc({"shared_storage_path": "/d", "format": "fp8", "layers": [2, 4], "convention": "before"}))
    assert s == {"out": "/d", "format": "fp8", "layers": [2, 4], "convention": "before"}
    assert requested.settings(vc({"shared_storage_path": "/d"}, name="OtherConnector")) is None
    assert requested.settings(NS(kv_transfer_config=None)) is None


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"shared_storage_path": "/d", "fromat": "fp8"}, "unknown keys \\['fromat'\\]"),
        ({"format": "file"}, "shared_storage_path"),
        ({"shared_storage_path": "  "}, "shared_storage_path"),
        ({"shared_storage_path": "stage/d"}, "a relative path; expected an absolute one"),
        ({"shared_storage_path": "/d", "format": "parquet"}, "format"),
        ({"shared_storage_path": "/d", "format": "mooncake"}, "writes no files; remove it"),
        ({"shared_storage_path": "/d", "mooncake": {}}, 'set "format": "mooncake" or remove it'),
        (
            {"format": "mooncake", "mooncake": {"master_server_adress": "h:1"}},
            "unknown keys \\['master_server_adress'\\]",
        ),
    ],
)
def test_bad_extra_config_is_refused_naming_the_key(extra, match):
    with pytest.raises(ConfigError, match=match):
        requested.settings(vc(extra))


def test_merged_with_additional_config_and_conflicts_refused():
    c = from_sources({"hscapture": {"layers": [1, 2], "convention": "before"}}, {"out": "/d", "format": "fp8"})
    assert (c.layers, c.out, c.format, c.per_request.kind) == ((1, 2), "/d", "fp8", "staging")
    c = from_sources({}, {"out": "/d", "format": "hscapture", "layers": [3], "convention": "before"})
    assert c.layers == (3,)
    with pytest.raises(ConfigError, match="layers is given twice with different values"):
        from_sources({"hscapture": {"layers": [1, 2], "convention": "before"}}, {"out": "/d", "layers": [1, 3]})
    with pytest.raises(ConfigError, match="out is given twice"):
        from_sources({"hscapture": {"layers": [1], "convention": "before", "out": "/e"}}, {"out": "/d"})
    with pytest.raises(ConfigError, match="on_nonfinite=skip with the KV connector"):
        from_sources({"hscapture": {"layers": [1], "convention": "before", "on_nonfinite": "skip"}}, {"out": "/d"})


def test_mooncake_takes_speculators_store_block_and_writes_no_files():
    s = requested.settings(vc({"format": "mooncake", "mooncake": {"master_server_address": "10.0.0.2:50051"}}))
    assert set(s) == {"mooncake"} and s["mooncake"]["master_server_address"] == "10.0.0.2:50051"
    assert s["mooncake"]["global_segment_size"] == 4 << 30 and s["mooncake"]["protocol"] == "tcp"
    s = requested.settings(vc({"format": "mooncake", "mooncake": {"num_writer_threads": 2}, "layers": [2]}))
    assert s["writer_threads"] == 2 and s["layers"] == [2]
    c = from_sources({"hscapture": {"layers": [1, 2], "convention": "before"}}, s | {"layers": [1, 2]})
    assert (c.out, c.per_request.kind, c.writer_threads, c.per_request.store["num_writer_threads"]) == (
        None,
        "store",
        2,
        2,
    )
    with pytest.raises(ConfigError, match="expected no output directory"):
        from_sources({"hscapture": {"layers": [1], "convention": "before", "out": "/e"}}, {"mooncake": {}})


def test_per_request_files_skip_fsync_unless_durable_is_asked_for(monkeypatch):
    """The client takes each file as its lock frees (atomic renames keep it whole); fsync only when asked."""
    monkeypatch.delenv("HSCAPTURE_DURABLE", raising=False)
    base = {"hscapture": {"layers": [1], "convention": "before"}}
    assert from_sources(base, {"out": "/d"}).durable is False
    assert from_sources({"hscapture": {**base["hscapture"], "durable": True}}, {"out": "/d"}).durable is True
    monkeypatch.setenv("HSCAPTURE_DURABLE", "1")
    assert from_sources(base, {"out": "/d"}).durable is True
    assert from_sources({"hscapture": {**base["hscapture"], "out": "/e"}}).durable is True, "a capture directory is"


def test_writeback_is_a_durability_between_rename_and_fsync(monkeypatch, tmp_path):
    """`durable: "writeback"` (setting or variable) reaches the core, which accepts it; other text is refused."""
    monkeypatch.setenv("HSCAPTURE_DURABLE", "WriteBack")
    base = {"hscapture": {"layers": [1], "convention": "before"}}
    assert from_sources(base, {"out": "/d"}).durable == _native.DURABLE_WRITEBACK
    monkeypatch.delenv("HSCAPTURE_DURABLE")
    assert (
        from_sources({"hscapture": {**base["hscapture"], "durable": "writeback"}}, {"out": "/d"}).durable == "writeback"
    )
    _native.Output({"kind": "staging", "root": str(tmp_path), "durable": _native.DURABLE_WRITEBACK})
    with pytest.raises(ConfigError, match="writeback"):
        from_sources({"hscapture": {**base["hscapture"], "durable": "later"}}, {"out": "/d"})
    with pytest.raises(_native.ConfigError, match="expected true, false or"):
        _native.Output({"kind": "directory", "root": str(tmp_path), "durable": "later"})


@pytest.mark.parametrize(
    "desc,why",
    [
        (
            {"kind": "store", "client": object(), "root": "/x"},
            r'a store destination takes \["kind", "client"\]; found "root"',
        ),
        ({"kind": "directory", "root": "/x", "backlog_mib": 1}, r'a directory destination takes .*found "backlog_mib"'),
        (
            {"kind": "parquet"},
            r'destination kind "parquet": expected one of \["memory", "directory", "staging", "store"\]',
        ),
        ({"root": "/x"}, "a destination without a kind"),
        ({"kind": "staging"}, "a staging destination needs a root"),
    ],
)
def test_a_destination_takes_only_its_own_settings(desc, why):
    """Where samples go is one description, and each kind takes only what it needs: an object store has no root or
    compression to be given (the rule is the shape of the type, not a check repeated in each language)."""
    with pytest.raises(ConfigError, match=why):
        _native.Output(desc)


@pytest.mark.parametrize(
    "name,value,getter",
    [
        ("HSCAPTURE_STAGING_BACKLOG_MIB", "-1", requested.staging_backlog_mib),
        ("HSCAPTURE_MAX_GROWING_SAMPLE_MIB", "0", requested.max_growing_sample_mib),
        ("HSCAPTURE_STAGING_COLLECT_S", "9", requested.staging_collect_s),
    ],
)
def test_the_server_s_bounds_are_refused_below_their_least(monkeypatch, name, value, getter):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=rf"{name}={value} is not valid: expected at least"):
        getter()
    monkeypatch.delenv(name)
    assert getter() == int(_native.DEFAULTS[name.removeprefix("HSCAPTURE_").lower()])
