"""hscapture's settings are checked in the process that builds vLLM's configuration (early_check.py), so an
``LLM(...)`` caller gets the typed error at once, not "Engine core initialization failed" after an engine start."""

import pytest

from hscapture import ConfigError


def engine_args(model, **kw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), dtype="float32", max_model_len=32, enforce_eager=True, **kw)


@pytest.mark.parametrize(
    "section,worker,match",
    [
        ({"layers": [1.5], "convention": "after", "out": "/x"}, "hscapture.worker.CaptureWorker", "layers=\\[1.5\\]"),
        (
            {"layers": [1], "convention": "after", "dtype": "int8", "out": "/x"},
            "hscapture.worker.CaptureWorker",
            "int8",
        ),
        (
            {"layers": [1], "convention": "after", "out": "/x", "extra": 1},
            "hscapture.worker.CaptureWorker",
            "unknown keys",
        ),
        ({"layers": [9], "convention": "after", "out": "/x"}, "hscapture.worker.CaptureWorker", "out of range"),
        ({"layers": [1], "convention": "after", "out": "/x"}, "auto", "does not capture.*--worker-cls hscapture"),
    ],
)
def test_bad_settings_fail_where_the_config_is_built(tiny_model, section, worker, match):
    args = engine_args(tiny_model("llama"), worker_cls=worker, additional_config={"hscapture": section})
    with pytest.raises(ConfigError, match=match):
        args.create_engine_config()


def test_good_settings_pass(tiny_model):
    section = {"layers": [1, 3], "convention": "after", "out": "/x"}
    args = engine_args(
        tiny_model("llama"), worker_cls="hscapture.worker.CaptureWorker", additional_config={"hscapture": section}
    )
    assert args.create_engine_config().additional_config["hscapture"]["layers"] == [1, 3]
    engine_args(tiny_model("llama")).create_engine_config()  # no hscapture settings: nothing to check


def test_pipeline_stages_with_tensor_parallelism_are_refused_by_name(tiny_model):
    """PP × TP is refused until the stages' rows are agreed before they are written (the last stage would write an
    earlier stage's rows before that stage's TP ranks compared them); PP or TP alone passes."""
    from hscapture import CompatibilityError
    from hscapture.adapters.parallel import refuse_stages_with_tp

    with pytest.raises(
        CompatibilityError, match=r"2 stages\) with tensor parallelism \(2 ranks.*--tensor-parallel-size 4"
    ):
        refuse_stages_with_tp(2, 2)
    refuse_stages_with_tp(2, 1)
    refuse_stages_with_tp(1, 8)
    section = {"layers": [1, 3], "convention": "after", "out": "/x"}
    args = engine_args(
        tiny_model("llama"),
        worker_cls="hscapture.worker.CaptureWorker",
        additional_config={"hscapture": section},
        pipeline_parallel_size=2,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )
    with pytest.raises(CompatibilityError, match="pipeline parallelism"):
        args.create_engine_config()


def test_a_server_that_takes_prompt_embeddings_is_refused_by_name(tiny_model):
    """With --enable-prompt-embeds any client could send a request without token ids, which no sample can name and
    which would stop the capture for every client: refused where the configuration is built."""
    section = {"layers": [1, 3], "convention": "after", "out": "/x"}
    args = engine_args(
        tiny_model("llama"),
        worker_cls="hscapture.worker.CaptureWorker",
        additional_config={"hscapture": section},
        enable_prompt_embeds=True,
    )
    with pytest.raises(ConfigError, match="--enable-prompt-embeds"):
        args.create_engine_config()
