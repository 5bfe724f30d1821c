"""`hscapture launch`: speculators' launcher's arguments in, a `vllm serve` on hscapture out (no server started)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from types import SimpleNamespace

import pytest

from hscapture.adapters import requested
from hscapture.cli import launch
from hscapture.errors import ConfigError
from support import speculators_path

SPECULATORS = speculators_path("0.9.0")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A config-only model directory of 12 layers (launch reads the config, never the weights)."""
    d = tmp_path_factory.mktemp("m")
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 12, "hidden_size": 64}))
    return str(d)


def dry_run(*argv: str) -> list[str]:
    """`hscapture launch ARGV --dry-run` as a user runs it (a subprocess); the command it would run."""
    at = argv.index("--") if "--" in argv else len(argv)
    out = subprocess.run(
        [sys.executable, "-m", "hscapture.cli.main", "launch", *argv[:at], "--dry-run", *argv[at:]],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    return shlex.split(lines[lines.index("Running command:") + 1])


def in_process(capsys, *argv: str) -> list[str]:
    """The same in this process (vLLM imported once for the whole module)."""
    assert launch.main([*argv, "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    return shlex.split(lines[lines.index("Running command:") + 1])


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_speculators_defaults_become_hscapture_worker_connector_and_layers(model, tmp_path):
    cmd = dry_run(model, "--hidden-states-path", str(tmp_path / "hs"), "--", "--port", "8011")
    assert cmd[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", model]
    assert flag(cmd, "--worker-cls") == "hscapture.worker.CaptureWorker"
    kv = json.loads(flag(cmd, "--kv-transfer-config"))
    assert kv["kv_connector"] == "HscaptureConnector" and kv["kv_role"] == "kv_producer"
    extra = kv["kv_connector_extra_config"]
    # speculators' default ids for 12 layers: [2, L // 2, L - 3, L], vLLM's convention
    assert extra == {
        "shared_storage_path": str(tmp_path / "hs"),
        "format": "file",
        "layers": [2, 6, 9, 12],
        "convention": "before",
    }
    assert flag(cmd, "--api-server-count") == "4"
    assert "--speculative_config" not in cmd and "--speculative-config" not in cmd
    assert cmd[-2:] == ["--port", "8011"]  # the caller's own arguments last, untouched
    # the connector's own reading of the settings accepts them as they are
    cfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(**{k: v for k, v in kv.items()}))
    assert requested.settings(cfg)["format"] == requested.FORMATS["file"]


def test_a_relative_path_is_made_absolute_and_the_callers_flags_win(model, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cmd = in_process(
        capsys, model, "--hidden-states-backend", "fp8", "--hidden-states-path", "rel", "--api_server_count=2"
    )
    extra = json.loads(flag(cmd, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert extra["format"] == "fp8" and extra["shared_storage_path"] == str(tmp_path / "rel")
    assert "--api-server-count" not in cmd and "--api_server_count=2" in cmd


def test_layer_ids_follow_speculators_rules_and_are_checked():
    assert launch.layer_ids(32, None, True) == [2, 16, 29, 32]
    assert launch.layer_ids(32, [3, 7], True) == [3, 7, 32]
    assert launch.layer_ids(32, [3, 7], False) == [3, 7]
    for bad in ([3, 33], [3, 3], [-1]):
        with pytest.raises(ConfigError, match=r"expected distinct ids within \[0, 32\]"):
            launch.layer_ids(32, bad, False)


def test_flags_hscapture_sets_itself_are_refused_by_name():
    kv = launch.kv_transfer_config({"kv_connector": "ExampleHiddenStatesConnector"}, [1])
    for extra in (["--worker-cls", "x.Y"], ["--kv_transfer_config={}"], ["--speculative-config", "{}"]):
        with pytest.raises(ConfigError, match="hscapture launch sets it itself"):
            launch.command("m", kv, extra, renderer_workers=True)
    cmd = launch.command("m", kv, [], renderer_workers=True)
    assert flag(cmd, "--renderer-num-workers") == "2"  # where this vLLM has it
    assert "--renderer-num-workers" not in launch.command("m", kv, [], renderer_workers=False)


def test_a_backend_whose_connector_hscapture_does_not_serve_is_refused():
    with pytest.raises(ConfigError, match="'SomeOtherConnector'.*Choose a backend"):
        launch.kv_transfer_config({"kv_connector": "SomeOtherConnector"}, [1])


@pytest.mark.skipif(
    not (SPECULATORS / "hs_connectors").is_dir(), reason="speculators 0.9.0 not installed beside the venv"
)
def test_hs_connectors_backends_and_their_flags_are_speculators_own(model, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(SPECULATORS))
    cmd = in_process(capsys, model, "--hidden-states-backend", "mooncake", "--mooncake-master", "10.0.0.9:50051")
    extra = json.loads(flag(cmd, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert extra["format"] == "mooncake" and "shared_storage_path" not in extra
    assert extra["mooncake"]["master_server_address"] == "10.0.0.9:50051"  # MooncakeStoreConfig's names, as theirs
