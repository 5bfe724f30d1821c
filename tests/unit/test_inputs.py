"""Prompt files and model checks, before vLLM starts."""

import json
import os

import pytest

from hscapture import ConfigError, OutputError
from hscapture.cli.extract import prepare_out
from hscapture.cli.inputs import PromptSet, check_prompts, input_kind, open_input, read_jsonl, read_prompts


def write(tmp_path, lines):
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_reads_token_ids(tmp_path):
    p = write(tmp_path, [json.dumps({"token_ids": [1, 2]}), "", json.dumps({"token_ids": [3]})])
    assert read_prompts(p) == [[1, 2], [3]]


@pytest.mark.parametrize(
    "line,match",
    [
        ("{bad", r"p.jsonl:1: not valid JSON"),
        (json.dumps({"text": 5}), r"p.jsonl:1: expected an object"),
        (json.dumps([1, 2]), r"p.jsonl:1: expected an object"),
        (
            json.dumps({"token_ids": [1, 2], "loss_mask": [1]}),
            r"p.jsonl:1: \"loss_mask\" must be a list of 0/1 as long",
        ),
        (json.dumps({"token_ids": [1, -2]}), r"non-negative"),
        (json.dumps({"token_ids": []}), r"p.jsonl:1: the prompt is empty"),
    ],
)
def test_bad_lines_name_the_line(tmp_path, line, match):
    with pytest.raises(ConfigError, match=match):
        read_prompts(write(tmp_path, [line]))


def model_dir(tmp_path, tokenizer: bool):
    d = tmp_path / ("model-tok" if tokenizer else "model")
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"vocab_size": 1024, "num_hidden_layers": 4}))
    if tokenizer:
        from hscapture.testing import tiny

        tiny._save_tokenizer(d)
    return d


def test_text_is_tokenized_with_the_model_tokenizer_or_tokenizer_option(tmp_path):
    p = write(tmp_path, [json.dumps({"text": "w5 w6 w700"}), json.dumps({"token_ids": [9, 8]})])
    with_tok = model_dir(tmp_path, tokenizer=True)
    assert read_prompts(p, with_tok) == [[5, 6, 700], [9, 8]]
    bare = model_dir(tmp_path, tokenizer=False)
    assert read_prompts(p, bare, tokenizer=str(with_tok)) == [[5, 6, 700], [9, 8]]


def test_text_without_a_tokenizer_is_refused_with_the_fix(tmp_path):
    p = write(tmp_path, [json.dumps({"token_ids": [9]}), json.dumps({"text": "w5"})])
    with pytest.raises(ConfigError, match=r"p.jsonl:2: .*model directory .* has no tokenizer files.*--tokenizer PATH"):
        read_prompts(p, model_dir(tmp_path, tokenizer=False))
    with pytest.raises(ConfigError, match=r"no tokenizer was given.*--tokenizer PATH"):
        read_prompts(p)
    with pytest.raises(ConfigError, match=r"cannot load a tokenizer from .*--tokenizer"):
        read_prompts(p, tokenizer=str(tmp_path))
    assert read_prompts(write(tmp_path, [json.dumps({"token_ids": [9]})]), model_dir(tmp_path, tokenizer=False)) == [
        [9]
    ], "token ids need no tokenizer"


def test_loss_masks_and_fingerprints(tmp_path):
    ps = read_jsonl(
        write(tmp_path, [json.dumps({"token_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}), json.dumps({"token_ids": [4]})]),
        None,
    )
    assert (len(ps), ps[0], ps.length(0), ps.loss_mask(0), ps.loss_mask(1), ps.max_token()) == (
        2,
        [1, 2, 3],
        3,
        [0, 1, 1],
        None,
        4,
    )
    same, other = PromptSet.from_lists([[1, 2, 3], [4]]), PromptSet.from_lists([[1, 2], [3, 4]])
    assert ps.fingerprint() == same.fingerprint() != other.fingerprint(), "the fingerprint sees row boundaries"


def test_input_kind_from_the_path(tmp_path):
    assert input_kind(write(tmp_path, [json.dumps({"token_ids": [1]})])) == "jsonl"
    ds = tmp_path / "ds"
    ds.mkdir()
    with pytest.raises(ConfigError, match="without dataset_info.json or state.json"):
        input_kind(ds)
    (ds / "state.json").write_text("{}")
    assert input_kind(ds) == "arrow"
    dd = tmp_path / "dd"
    (dd / "train").mkdir(parents=True)
    (dd / "dataset_dict.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"splits \['train'\].*--input .*dd/train"):
        input_kind(dd)
    (tmp_path / "p.json").write_text("[]")
    with pytest.raises(ConfigError, match="neither a .jsonl file nor a dataset directory"):
        input_kind(tmp_path / "p.json")
    with pytest.raises(ConfigError, match="does not exist"):
        open_input(tmp_path / "missing.jsonl", tmp_path)


def test_prompt_checks_against_the_model():
    cfg = {"vocab_size": 10, "max_position_embeddings": 8}
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        check_prompts([[1, 10]], cfg)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        check_prompts([[1] * 8], cfg)
    check_prompts([[1] * 7], cfg)
    check_prompts([[1] * 7, [1] * 9], cfg, rows=[0]), "only the rows this run (shard) captures"


def test_existing_output_needs_overwrite(tmp_path):
    prepare_out(tmp_path, overwrite=False)
    (tmp_path / "hidden_states" / "hs_0.safetensors").write_bytes(b"x")
    with pytest.raises(OutputError, match="--overwrite"):
        prepare_out(tmp_path, overwrite=False)
    (tmp_path / "hidden_states" / ".hs_1.safetensors.partial-9-0").write_bytes(b"x")
    prepare_out(tmp_path, overwrite=False, resume=True)
    assert [p.name for p in (tmp_path / "hidden_states").iterdir()] == ["hs_0.safetensors"], (
        "resume keeps finished files, drops partial ones"
    )
    with pytest.raises(ConfigError, match="contradict"):
        prepare_out(tmp_path, overwrite=True, resume=True)
    prepare_out(tmp_path, overwrite=True)
    assert not any((tmp_path / "hidden_states").iterdir())


def test_cpu_binding_follows_the_world_size(monkeypatch):
    from hscapture import runtime_env

    monkeypatch.setattr(runtime_env, "has_cuda", lambda: False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv(runtime_env.MARK, raising=False)
    assert runtime_env.omp_binding(2, cores=2) == "0|1" and runtime_env.omp_binding(1, cores=4) == "0-3"
    runtime_env.apply(1)
    runtime_env.apply(2)  # a later run in the same process with another TP size
    import os

    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == runtime_env.omp_binding(2)
    import json
    import subprocess
    import sys

    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os; from hscapture import runtime_env as r; r.has_cuda = lambda: False; "
            "r.apply(1); print(os.environ['VLLM_CPU_OMP_THREADS_BIND'])",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ),
    )
    assert child.stdout.strip() == runtime_env.omp_binding(1), "a child process may replace what its parent's run chose"
    assert json.loads(os.environ[runtime_env.MARK])["VLLM_CPU_OMP_THREADS_BIND"] == runtime_env.omp_binding(2)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    runtime_env.apply(1)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind", "the user's value is kept"


def test_one_run_per_output_directory(tmp_path):
    import subprocess
    import sys

    from hscapture import OutputError
    from hscapture.output.outlock import OutputLock

    probe = (
        "import sys\nfrom hscapture.output.outlock import OutputLock\nfrom hscapture import OutputError\n"
        "try:\n    OutputLock(sys.argv[1]).acquire()\nexcept OutputError as e:\n    print('REFUSED', e)\n"
    )
    with OutputLock(tmp_path):
        r = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True)
        assert "REFUSED" in r.stdout and "another hscapture run (pid" in r.stdout, r.stdout + r.stderr
        with pytest.raises(OutputError, match="another hscapture run"):
            OutputLock(tmp_path).acquire()  # flock is per open file: a second run in this process is refused too
    r = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True)
    assert "REFUSED" not in r.stdout, "the lock is released when the run ends"


def test_an_unwritable_output_is_refused_before_vllm_starts(tmp_path):
    from hscapture import OutputError

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OutputError, match="cannot write to .*choose a directory you can write"):
        prepare_out(blocker / "out", overwrite=False)


def test_damaged_lines_are_typed_errors_with_file_and_line(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_bytes(b'{"token_ids": [1, 2]}\n{"token_ids": [3], "x": "\xff"}\n')
    with pytest.raises(ConfigError, match=r"p.jsonl:2: not UTF-8 text \(byte 0xff"):
        read_prompts(p)
    with pytest.raises(ConfigError, match=r"p.jsonl:1: token id 9223372036854775808 does not fit a signed 64-bit"):
        read_prompts(write(tmp_path, [json.dumps({"token_ids": [1, 2**63]})]))
    with pytest.raises(ConfigError, match=r'p.jsonl:1: the line has both "token_ids" and "text"'):
        read_prompts(write(tmp_path, [json.dumps({"token_ids": [1], "text": "w1"})]))
    with pytest.raises(ConfigError, match=r'p.jsonl:1: the tokenizer cannot encode this "text"'):
        read_prompts(write(tmp_path, ['{"text": "w5 \\ud800"}']), model_dir(tmp_path, tokenizer=True))


def test_a_prompt_is_named_by_its_index_and_its_line(tmp_path):
    ps = read_jsonl(
        write(tmp_path, [json.dumps({"token_ids": [1]}), "", json.dumps({"token_ids": [1, 2, 3, 4]})]), None
    )
    with pytest.raises(ConfigError, match=r"prompt 1 \(line 3 of .*p.jsonl\) has 4 tokens; --max-model-len 4 accepts"):
        check_prompts(ps, {"vocab_size": 10}, max_model_len=4)
    check_prompts(ps, {"vocab_size": 10}, max_model_len=5)


def test_model_configs_are_read_with_their_own_names(tmp_path):
    from hscapture.cli.inputs import model_field, read_model_config

    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config.json is not valid JSON"):
        read_model_config(tmp_path)
    gpt2 = {"n_layer": 12, "n_embd": 768, "n_positions": 1024, "vocab_size": 50257}
    assert [model_field(gpt2, k) for k in ("num_hidden_layers", "hidden_size", "max_position_embeddings")] == [
        12,
        768,
        1024,
    ]
    with pytest.raises(ConfigError, match=r"has no num_hidden_layers \(looked for num_hidden_layers, n_layer"):
        model_field({"hidden_size": 8}, "num_hidden_layers")
    vl = {"vision_config": {"num_hidden_layers": 32}, "text_config": {"num_hidden_layers": 28, "hidden_size": 64}}
    assert model_field(vl, "num_hidden_layers") == 28, "a multimodal config's text model"
    # Hybrid decoders that give their depth as one entry per layer (NemotronH as transformers 5 saves it, and as
    # its checkpoints spell it); an explicit count wins.
    nemotron_h = {"hidden_size": 64, "layers_block_type": ["mamba", "moe", "attention", "mlp", "mamba"]}
    assert model_field(nemotron_h, "num_hidden_layers") == 5
    assert model_field({"hybrid_override_pattern": "M-M*-"}, "num_hidden_layers") == 5
    assert model_field({"num_hidden_layers": 4, "layer_types": ["attention"] * 6}, "num_hidden_layers") == 4
    with pytest.raises(ConfigError, match=r"hybrid_override_pattern, layer_types \(one entry per layer\)"):
        model_field({"layer_types": []}, "num_hidden_layers")


def test_output_paths_that_cannot_be_directories_are_typed_errors(tmp_path):
    from hscapture.output.outlock import OutputLock

    f = tmp_path / "file"
    f.write_text("x")
    for bad in (f, f / "out"):
        with pytest.raises(OutputError, match="choose a directory you can write"):
            OutputLock(bad).acquire()
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user who may write anywhere (root): a read-only directory cannot be made")
        with pytest.raises(OutputError, match="choose a directory you can write"):
            OutputLock(ro / "out").acquire()
    finally:
        ro.chmod(0o700)


def test_a_refused_run_leaves_no_lock_behind(tmp_path):
    from hscapture.output.outlock import OutputLock

    out = tmp_path / "new"
    with OutputLock(out):
        pass
    assert not out.exists(), "a run that wrote nothing leaves neither its lock nor the directory it made"
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "mine.txt").write_text("x")
    with OutputLock(tmp_path / "kept"):
        pass
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == [".hscapture.lock", "mine.txt"]
