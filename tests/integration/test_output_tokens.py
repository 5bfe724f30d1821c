"""Prompt and response in one pass: a request whose ``kv_transfer_params`` set ``include_output_tokens`` gets the
states of every token that went through a forward — its prompt and its generated tokens but the last, as
speculators' connector defines it (``request.all_token_ids[:-1]``) — from one generation. Requests of different
lengths run concurrently (mixed prefill and decode steps, chunked prefill in 32-token steps), beside one that asks
for its prompt only; each file must equal HF transformers' states of exactly those tokens (greedy), TP=1 and TP=2;
and the capture changes no generated token."""

from __future__ import annotations

import fcntl
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from connector_support import LAYERS, VLLM_ARGS, load, serve
from server import Server

from hscapture import runtime_env

pytestmark = [pytest.mark.integration, pytest.mark.newest]


def complete(server, prompt: list[int], max_tokens: int, **extra) -> dict:
    """Greedy completion of exactly `max_tokens` tokens; the answer carries its token ids."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    status, answer = server.post(
        "/v1/completions", body | {"ignore_eos": True, "return_token_ids": True, **extra}, timeout=300
    )
    assert status == 200, answer
    return answer


def ask(server, prompt: list[int], max_tokens: int, outputs: bool) -> tuple[list[int], list[int], Path]:
    """A capturing server's answer: (prompt, generated ids, its whole file's path)."""
    params = {"kv_transfer_params": {"include_output_tokens": True}} if outputs else {}
    answer = complete(server, prompt, max_tokens, **params)
    generated = list(answer["choices"][0]["token_ids"])
    path = Path(answer["kv_transfer_params"]["hidden_states_path"])
    with open(str(path) + ".lock", "rb") as lock:  # held from the request's first step until the file is whole
        fcntl.flock(lock, fcntl.LOCK_EX)
    return prompt, generated, path


@pytest.mark.parametrize("tp", [1, 2])
def test_prompt_and_generated_tokens_equal_hf_and_the_capture_changes_no_token(tmp_path, tiny_model, tp):
    """One capturing server, then the same server without capture:
    - one request at a time (so both servers compute the same batches), greedy, 40 tokens each, two with
      `include_output_tokens` and one prompt-only: the capturing server generates exactly the plain server's
      tokens (vLLM's own extraction once changed generated tokens when turned on);
    - then five concurrent requests of mixed lengths, the last prompt-only (mixed prefill and decode steps);
    every file holds exactly its tokens, and their states equal HF's."""

    model = tiny_model("llama", "float32")
    rng = random.Random(7 + tp)
    alone = [[rng.randrange(4, 1000) for _ in range(rng.randint(5, 60))] for _ in range(3)]
    prompts = [[rng.randrange(4, 1000) for _ in range(rng.randint(3, 70))] for _ in range(5)]
    lengths = [1, 4, 9, 17, 6]
    server, _stage = serve(tmp_path, model, "file", tp=tp)
    with server:
        results = [ask(server, p, 40, outputs=k < 2) for k, p in enumerate(alone)]
        with ThreadPoolExecutor(5) as pool:
            jobs = [
                pool.submit(ask, server, p, n, k < 4) for k, (p, n) in enumerate(zip(prompts, lengths, strict=True))
            ]
            results += [j.result() for j in jobs]
    on = [generated for _prompt, generated, _path in results[:3]]
    args = [*VLLM_ARGS, "--tensor-parallel-size", str(tp)] + (
        ["--distributed-executor-backend", "mp"] if tp > 1 else []
    )
    with Server(tmp_path, model, *args, env=runtime_env.cpu_defaults(tp), name=f"plain-tp{tp}") as plain:
        off = [list(complete(plain, p, 40)["choices"][0]["token_ids"]) for p in alone]
    assert [len(t) for t in on] == [40, 40, 40]
    assert on == off, "the capture changed generated tokens"

    assert [len(g) for _p, g, _path in results] == [40, 40, 40, *lengths]
    files_equal_hf(model, tmp_path, results, outputs=[True, True, False, True, True, True, True, False])


def files_equal_hf(
    model: str, tmp: Path, results: list[tuple[list[int], list[int], Path]], outputs: list[bool]
) -> None:
    """Each answer's file holds exactly its tokens (its prompt, and where it asked for them its generated tokens but
    the last), each row equal to HF transformers' state of that token (float32, 1e-4 of the row's norm)."""
    from hscapture.testing import reference

    expected = []
    for k, (prompt, generated, path) in enumerate(results):
        tokens = prompt + generated[:-1] if outputs[k] else prompt
        got = load(path)
        assert got["token_ids"].tolist() == tokens, f"request {k}: token ids"
        assert tuple(got["hidden_states"].shape) == (len(tokens), len(LAYERS), 128), f"request {k}"
        expected.append((tokens, got["hidden_states"]))
    ref = reference.compute_subprocess(model, [t for t, _ in expected], LAYERS, "before", tmp / "ref")
    for k, ((_tokens, ours), theirs) in enumerate(zip(expected, ref, strict=True)):
        theirs = theirs.float()
        err = torch.linalg.vector_norm(ours - theirs, dim=-1) / torch.linalg.vector_norm(theirs, dim=-1)
        assert float(err.max()) < 1e-4, f"request {k}: {float(err.max()):.2e} from HF at position {int(err.argmax())}"


def test_a_request_that_could_outgrow_the_bound_fails_itself_at_admission(tmp_path, tiny_model):
    """HSCAPTURE_MAX_GROWING_SAMPLE_MIB=1 (682 rows of 3 layers × 128 float32 values): a request asking for
    `include_output_tokens` with 10 prompt tokens and max_tokens 800 could reach 809 rows. Its answer carries
    `hidden_states_error` and no path, no file of it appears, its tokens are generated as usual; the requests before
    and after it (one under the bound by one row, one prompt-only) get their files, and the server serves on."""
    model = tiny_model("llama", "float32")
    prompt = list(range(5, 15))
    env = {"HSCAPTURE_MAX_GROWING_SAMPLE_MIB": "1"}
    server, stage = serve(tmp_path, model, "file", env=env, extra=["--max-model-len", "1024"])
    outputs = {"kv_transfer_params": {"include_output_tokens": True}}
    with server:
        _p, edge, edge_path = ask(server, prompt, 682 - 10 + 1, outputs=True)  # exactly the bound: 682 rows
        refused = complete(server, prompt, 800, **outputs)
        _p, _g, after = ask(server, prompt, 3, outputs=False)
        log = server.log()
    params = refused["kv_transfer_params"]
    assert "hidden_states_path" not in params, params
    assert "refused at admission" in params["hidden_states_error"], params
    assert "max_tokens (800)" in params["hidden_states_error"] and "809 rows" in params["hidden_states_error"]
    assert len(refused["choices"][0]["token_ids"]) == 800, "the request itself runs as usual"
    assert "refused at admission" in log, log[-3000:]
    assert load(edge_path)["token_ids"].tolist() == prompt + edge[:-1]
    assert load(after)["token_ids"].tolist() == prompt
    files = sorted(p.name for p in stage.iterdir() if p.name.endswith(".safetensors"))
    assert files == sorted([edge_path.name, after.name]), files


def test_an_fp8_server_quantizes_prompt_and_response_token_by_token(tmp_path, tiny_model):
    """`format: fp8` with `include_output_tokens`: a growing sample's rows are quantized a token at a time (fp8's
    scale is per token), so prompt-and-response requests run concurrently beside a prompt-only one and each file
    holds exactly its tokens, with speculators' own quantization of HF's states (codes equal but for float32 noise,
    every value within the fp8 step)."""
    from hscapture.testing import reference
    from support import speculators_path

    sys.path.insert(0, str(speculators_path("0.9.0")))
    try:
        from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8
    finally:
        sys.path.pop(0)
    model = tiny_model("llama", "float32")
    rng = random.Random(11)
    prompts = [[rng.randrange(4, 1000) for _ in range(rng.randint(3, 70))] for _ in range(4)]
    lengths, outputs = [12, 1, 25, 7], [True, True, True, False]
    server, stage = serve(tmp_path, model, "fp8")
    with server, ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(ask, server, p, n, o) for p, n, o in zip(prompts, lengths, outputs, strict=True)]
        results = [j.result() for j in jobs]
    expected = []
    for k, (prompt, generated, path) in enumerate(results):
        tokens = prompt + generated[:-1] if outputs[k] else prompt
        got = load(path)
        assert got["token_ids"].tolist() == tokens, f"request {k}: token ids"
        assert got["hidden_states"].dtype == torch.float8_e4m3fn
        assert tuple(got["hidden_states"].shape) == (len(tokens), len(LAYERS), 128), f"request {k}"
        assert tuple(got["hidden_states_scales"].shape) == (len(tokens), 1, 1), f"request {k}: one scale per token"
        expected.append((tokens, got))
    ref = reference.compute_subprocess(model, [t for t, _ in expected], LAYERS, "before", tmp_path / "ref")
    for k, ((_tokens, got), theirs) in enumerate(zip(expected, ref, strict=True)):
        theirs = theirs.float()
        codes, _scales = quantize_tensor_to_fp8(theirs)
        same = (got["hidden_states"].view(torch.uint8) == codes.view(torch.uint8)).float().mean()
        assert float(same) >= 0.995, f"request {k}: only {float(same):.4f} of the codes equal speculators' quantizer"
        deq = dequantize_fp8_tensor(got["hidden_states"], got["hidden_states_scales"]).float()
        # Half an e4m3 ulp of each value (2^-4 relative) or of the scale's denormals, and float32 noise from HF.
        bound = theirs.abs() * (2**-4 + 2**-7) + got["hidden_states_scales"].float() * 2**-9 + 1e-4
        assert bool(((deq - theirs).abs() <= bound).all()), f"request {k}: dequantized beyond the fp8 step of HF's"
    assert not [p for p in stage.iterdir() if p.name.endswith(".partial")]


def preemptions(server) -> float:
    """vLLM's count of preempted requests so far (its Prometheus counter)."""
    import urllib.request

    with urllib.request.urlopen(server.base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    found = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:num_preemptions")]
    assert found, "vLLM's /metrics has no vllm:num_preemptions counter"
    return sum(found)


def test_preempted_requests_keep_exactly_their_tokens_rows(tmp_path, tiny_model):
    """A KV cache too small for the requests running together (10 blocks of 32 tokens; six requests of 40 prompt +
    80 generated tokens need 24): vLLM preempts requests and recomputes them from their first token when they
    resume, prompt and generated tokens alike. Every file must still hold exactly its request's tokens once, each
    row equal to HF's state of that token (the recomputed steps' rows replace, never add to, what the preempted
    request had captured), and every request generates its 80 tokens."""

    model = tiny_model("llama", "float32")
    rng = random.Random(5)
    prompts = [[rng.randrange(4, 1000) for _ in range(40)] for _ in range(6)]
    outputs = [True, True, True, True, True, False]
    server, stage = serve(tmp_path, model, "file", extra=["--block-size", "32", "--num-gpu-blocks-override", "10"])
    with server, ThreadPoolExecutor(6) as pool:
        before = preemptions(server)
        jobs = [pool.submit(ask, server, p, 80, o) for p, o in zip(prompts, outputs, strict=True)]
        results = [j.result() for j in jobs]
        preempted = preemptions(server) - before
    assert preempted > 0, "the test's premise: vLLM preempted requests (its KV cache holds 10 blocks of 32 tokens)"
    assert [len(g) for _p, g, _path in results] == [80] * 6
    files_equal_hf(model, tmp_path, results, outputs)
    files = sorted(p.name for p in stage.iterdir() if p.name.endswith(".safetensors"))
    assert files == sorted(path.name for _p, _g, path in results), files
