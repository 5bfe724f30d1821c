"""The command line, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import prompts

from support import MOE_FLOAT32_REASON, moe_float32_runs

pytestmark = pytest.mark.integration

HSCAPTURE = [sys.executable, "-m", "hscapture.cli.main"]


def run(args, **kw):
    return subprocess.run(HSCAPTURE + args, capture_output=True, text=True, env={**os.environ}, **kw)


def test_extract_writes_files_and_manifest_then_refuses_to_overwrite(tmp_path, tiny_model):
    model = tiny_model("llama")
    inp = tmp_path / "p.jsonl"
    ps = prompts(3, lengths=(9, 33, 4))
    inp.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in ps))
    out = tmp_path / "out"
    args = [
        "extract",
        "--model",
        model,
        "--input",
        str(inp),
        "--out",
        str(out),
        "--layers",
        "1,3",
        "--convention",
        "after",
        "--dtype",
        "float32",
        "--store-dtype",
        "bfloat16",
        "--max-num-batched-tokens",
        "16",
    ]
    # vLLM's own engine arguments pass through (checked against its EngineArgs); two requests per step at most
    r = run(args + ["--vllm-arg", "max_num_seqs=2", "--vllm-arg", "enable-chunked-prefill=true", "--trust-remote-code"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "samples     3" in r.stdout and "tokens      46" in r.stdout
    m = json.loads((out / "manifest.json").read_text())
    assert (m["layer_ids"], m["convention"], m["dtype"], m["hidden_size"]) == ([1, 3], "after", "bfloat16", 128)
    assert [s["index"] for s in m["samples"]] == [0, 1, 2]
    assert [s["length"] for s in m["samples"]] == [9, 33, 4]
    assert sorted(p.name for p in (out / "hidden_states").iterdir()) == [f"hs_{i}.safetensors" for i in range(3)]
    from hscapture import load_sample

    s = load_sample(out / "hidden_states" / "hs_1.safetensors")
    assert str(s["hidden_states"].dtype) == "torch.bfloat16" and s["checksum"] == m["samples"][1]["checksum"]
    again = run(args)
    assert again.returncode == 2 and "OutputError" in again.stderr and "--overwrite" in again.stderr


@pytest.mark.parametrize(
    "layers,convention,match",
    [
        ("4", "after", "out of range for the `after` convention"),
        ("1,1", "before", "listed twice"),
        ("-1", "before", "negative"),
    ],
)
def test_bad_layer_ids_fail_before_vllm_starts(tmp_path, tiny_model, layers, convention, match):
    inp = tmp_path / "p.jsonl"
    inp.write_text('{"token_ids": [5, 6]}\n')
    r = run(
        [
            "extract",
            "--model",
            tiny_model("llama"),
            "--input",
            str(inp),
            "--out",
            str(tmp_path / "o"),
            f"--layers={layers}",
            "--convention",
            convention,
        ],
        timeout=60,
    )
    assert r.returncode == 2 and "ConfigError" in r.stderr and match in r.stderr, r.stderr


@pytest.mark.skipif(not moe_float32_runs(), reason=MOE_FLOAT32_REASON)
def test_demo(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "hscapture.cli.main", "demo", "--out", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "HSCAPTURE_CACHE": os.environ.get("HSCAPTURE_CACHE", str(Path.home() / ".cache" / "hscapture")),
        },
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "PASS" in r.stdout and "samples     12" in r.stdout


def test_prefix_caching_is_refused_with_a_typed_error(tmp_path, tiny_model):
    """A prompt prefix served from vLLM's cache is never computed: asked for under hscapture, prefix caching is
    refused with a ConfigError before the engine starts (the worker's own refusal is tested in test_session)."""
    from helpers import extract

    from hscapture import ConfigError

    shared = prompts(11, lengths=(48,))[0]
    ps = [shared + [5, 6], shared + [7, 8, 9]]
    with pytest.raises(ConfigError, match="prefix caching is on") as e:
        extract(
            tmp_path,
            tiny_model("llama"),
            ps,
            tp=1,
            convention="after",
            layers=[1],
            chunk=64,
            llm_kwargs={"enable_prefix_caching": True, "max_num_seqs": 1},
        )
    assert "--no-enable-prefix-caching" in str(e.value)
    assert not (tmp_path / "out" / "manifest.json").exists()
