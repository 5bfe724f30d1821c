"""The KV connector's settings: read from kv_connector_extra_config, checked, merged with additional_config."""

from types import SimpleNamespace as NS

import pytest

from hscapture import ConfigError, connector
from hscapture.config import from_sources


def vc(extra, name="HscaptureConnector"):
    return NS(kv_transfer_config=NS(kv_connector=name, kv_connector_extra_config=extra))


def test_the_issue_s_spelling_and_the_shorter_ones():
    assert connector.settings(vc({"shared_storage_path": "/d", "format": "file"})) == {
        "out": "/d",
        "format": "hscapture",
    }
    s = connector.settings(vc({"shared_storage_path": "/d", "format": "fp8", "layers": [2, 4], "convention": "before"}))
    assert s == {"out": "/d", "format": "fp8", "layers": [2, 4], "convention": "before"}
    assert connector.settings(vc({"shared_storage_path": "/d"}, name="OtherConnector")) is None
    assert connector.settings(NS(kv_transfer_config=None)) is None


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"shared_storage_path": "/d", "fromat": "fp8"}, "unknown keys \\['fromat'\\]"),
        ({"format": "file"}, "shared_storage_path"),
        ({"shared_storage_path": "  "}, "shared_storage_path"),
        ({"shared_storage_path": "/d", "format": "mooncake"}, "format"),
    ],
)
def test_bad_extra_config_is_refused_naming_the_key(extra, match):
    with pytest.raises(ConfigError, match=match):
        connector.settings(vc(extra))


def test_merged_with_additional_config_and_conflicts_refused():
    c = from_sources({"hscapture": {"layers": [1, 2], "convention": "before"}}, {"out": "/d", "format": "fp8"})
    assert (c.layers, c.out, c.format, c.staging) == ((1, 2), "/d", "fp8", True)
    c = from_sources({}, {"out": "/d", "format": "hscapture", "layers": [3], "convention": "before"})
    assert c.layers == (3,)
    with pytest.raises(ConfigError, match="layers is given twice with different values"):
        from_sources({"hscapture": {"layers": [1, 2], "convention": "before"}}, {"out": "/d", "layers": [1, 3]})
    with pytest.raises(ConfigError, match="out is given twice"):
        from_sources({"hscapture": {"layers": [1], "convention": "before", "out": "/e"}}, {"out": "/d"})
    with pytest.raises(ConfigError, match="on_nonfinite=skip with the KV connector"):
        from_sources({"hscapture": {"layers": [1], "convention": "before", "on_nonfinite": "skip"}}, {"out": "/d"})
