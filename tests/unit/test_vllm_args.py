"""`extract --vllm-arg KEY=VALUE` and `--trust-remote-code`: vLLM's own engine arguments pass through, checked
against vLLM's EngineArgs before anything starts; the keys hscapture sets itself are refused, naming its flag."""

from __future__ import annotations

import json

import pytest

from hscapture.cli import main as cli
from hscapture.cli import vllm_args
from hscapture.errors import ConfigError


def test_values_read_as_json_else_as_text_and_dashes_as_underscores():
    got = vllm_args.parse(
        [
            "gpu_memory_utilization=0.9",
            "enable-expert-parallel=true",
            "max_num_seqs=64",
            "quantization=fp8",
            'hf_overrides={"num_experts": 8}',
            "kv_cache_dtype=fp8",
            "enable_prefix_caching=false",
            "tokenizer_mode=auto",
        ]
    )
    assert got == {
        "gpu_memory_utilization": 0.9,
        "enable_expert_parallel": True,
        "max_num_seqs": 64,
        "quantization": "fp8",
        "hf_overrides": {"num_experts": 8},
        "kv_cache_dtype": "fp8",
        "enable_prefix_caching": False,
        "tokenizer_mode": "auto",
    }
    assert vllm_args.parse(None) == {} and vllm_args.parse([]) == {}
    # Python's spellings too; a number stays text where the field takes text but no number (a commit id)
    got = vllm_args.parse(["enforce-eager-is-ours=1"], fields={"enforce_eager_is_ours": "int"})
    assert got == {"enforce_eager_is_ours": 1}
    got = vllm_args.parse(
        [
            "enable_chunked_prefill=False",
            "max_num_seqs=None",
            "revision=1234567",
            "served_model_name=123",
            "max_num_batched_tokens_x=1e3",
        ],
        fields={
            "enable_chunked_prefill": "bool | None",
            "max_num_seqs": "int | None",
            "revision": "str | None",
            "served_model_name": "str | list[str] | None",
            "max_num_batched_tokens_x": "int",
        },
    )
    assert got == {
        "enable_chunked_prefill": False,
        "max_num_seqs": None,
        "revision": "1234567",
        "served_model_name": "123",
        "max_num_batched_tokens_x": 1000.0,
    }


def test_a_typo_is_named_with_the_nearest_fields():
    with pytest.raises(
        ConfigError, match="gpu_memory_utilisation: not one of vLLM's engine arguments.*nearest: gpu_memory_utilization"
    ):
        vllm_args.parse(["gpu_memory_utilisation=0.9"])


@pytest.mark.parametrize(
    "key,flag",
    [
        ("tensor_parallel_size", "--tp"),
        ("pipeline-parallel-size", "--pp"),
        ("model", "--model"),
        ("enforce_eager", "--compile"),
        ("trust_remote_code", "--trust-remote-code"),
        ("worker_cls", "own worker"),
        ("additional_config", "hscapture's own flags"),
        ("max_num_batched_tokens", "--max-num-batched-tokens"),
        ("tokenizer", "--tokenizer"),
    ],
)
def test_keys_hscapture_sets_are_refused_naming_its_flag(key, flag):
    with pytest.raises(ConfigError, match=f"sets this itself; use .*{flag}"):
        vllm_args.parse([f"{key}=1"])


@pytest.mark.parametrize(
    "item,match",
    [
        ("gpu_memory_utilization", "expects KEY=VALUE"),
        ("=3", "expects KEY=VALUE"),
        ("enable_prefix_caching=true", "never computed"),
        ("enable_prefix_caching=True", "never computed"),
        ("enable_prefix_caching=null", "never computed"),  # None: vLLM's default, which is on
        ("enable_prefix_caching=1", "never computed"),
    ],
)
def test_malformed_items_and_prefix_caching_are_refused(item, match):
    with pytest.raises(ConfigError, match=match):
        vllm_args.parse([item], fields={"gpu_memory_utilization": "float", "enable_prefix_caching": "bool | None"})
    assert vllm_args.parse(["enable_prefix_caching=False"], fields={"enable_prefix_caching": "bool | None"}) == {
        "enable_prefix_caching": False
    }


def test_a_key_given_twice_is_refused():
    with pytest.raises(ConfigError, match="max_num_seqs is given twice"):
        vllm_args.parse(["max_num_seqs=8", "max-num-seqs=16"], fields={"max_num_seqs": "int | None"})


def test_every_key_extract_sets_is_owned_or_deliberately_left_to_the_user():
    """A drift check: the keyword arguments the extraction gives vllm.LLM, read from its source, are each either
    refused here (hscapture's to set) or on the short list that may be overridden on purpose."""
    import ast
    import inspect

    from hscapture.cli import extract

    tree = ast.parse(inspect.getsource(extract._engine_kwargs))
    built = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["kwargs"]
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) == "dict"
        ):
            built |= {k.arg for k in node.value.keywords if k.arg}
        if (
            isinstance(node, ast.Subscript)
            and getattr(node.value, "id", None) == "kwargs"
            and isinstance(node.slice, ast.Constant)
        ):
            built.add(node.slice.value)
    assert "worker_cls" in built and "tensor_parallel_size" in built, (
        built
    )  # the walk found the dict of _capture (where vllm.LLM starts)
    overridable = {"seed", "disable_log_stats", "use_tqdm_on_load", "enable_prefix_caching"}
    assert built - set(vllm_args._OWNED) - overridable == set()


def _inputs(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    inp = tmp_path / "p.jsonl"
    inp.write_text('{"token_ids": [5, 6]}\n')
    return [
        "extract",
        "--model",
        str(tmp_path / "m"),
        "--input",
        str(inp),
        "--out",
        str(tmp_path / "o"),
        "--convention",
        "after",
    ]


def test_the_cli_hands_them_to_the_extraction(tmp_path, monkeypatch):
    from hscapture.cli import extract

    seen = {}

    def fake_run(opts):
        seen["opts"] = opts
        raise ConfigError("stop here")

    monkeypatch.setattr(extract, "run_extract", fake_run)
    rc = cli.main(
        _inputs(tmp_path) + ["--vllm-arg", "max_num_seqs=4", "--vllm-arg", "kv_cache_dtype=fp8", "--trust-remote-code"]
    )
    assert rc == 2
    opts = seen["opts"]
    assert opts.llm_kwargs == {"max_num_seqs": 4, "kv_cache_dtype": "fp8"} and opts.trust_remote_code is True


def test_a_bad_vllm_arg_fails_before_the_input_is_read(tmp_path, monkeypatch, capsys):
    from hscapture.cli import inputs

    def never(*a, **k):
        raise AssertionError("the input was read before the engine arguments were checked")

    monkeypatch.setattr(inputs, "open_input", never)
    rc = cli.main(_inputs(tmp_path) + ["--vllm-arg", "tensor_parallel_size=8"])
    err = capsys.readouterr().err
    assert rc == 2 and "ConfigError" in err and "use --tp" in err, err


def test_trust_remote_code_reaches_the_tokenizer(monkeypatch, tmp_path):
    import transformers

    from hscapture.cli.inputs import load_tokenizer

    calls = []

    class FakeTokenizer:
        @staticmethod
        def from_pretrained(where, **kw):
            calls.append(kw)
            return lambda text: {"input_ids": [1, 2]}

    monkeypatch.setattr(transformers, "AutoTokenizer", FakeTokenizer)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert load_tokenizer(tmp_path, None, True)("hi") == [1, 2]
    assert load_tokenizer(tmp_path, None)("hi") == [1, 2]
    assert calls == [{"trust_remote_code": True}, {"trust_remote_code": False}]


@pytest.mark.parametrize(
    "item,match",
    [
        ("max_num_seqs=abc", r"max_num_seqs=abc: vLLM reads --max-num-seqs as int and refuses this value"),
        ("gpu_memory_utilization=high", r"--gpu-memory-utilization as float"),
        ("enable_expert_parallel=3", r"--enable-expert-parallel is a switch; expected true or false"),
        ("kv_cache_dtype=int3", r"--kv-cache-dtype takes one of \[.*'fp8'"),
    ],
)
def test_values_are_read_by_vllm_s_own_parser(item, match):
    """Not only the key: the value too, as vLLM's command line would read it (before vLLM starts)."""
    with pytest.raises(ConfigError, match=match):
        vllm_args.parse([item])


def test_good_values_pass_vllm_s_parser():
    got = vllm_args.parse(
        [
            "max_num_seqs=64",
            "enable_expert_parallel=true",
            "kv_cache_dtype=fp8",
            'hf_overrides={"rope_theta": 1000}',
            "gpu_memory_utilization=0.9",
        ]
    )
    assert (
        got["max_num_seqs"] == 64
        and got["enable_expert_parallel"] is True
        and got["hf_overrides"] == {"rope_theta": 1000}
    )
