"""Prompt and response in one pass: a request whose ``kv_transfer_params`` set ``include_output_tokens`` gets the
states of every token that went through a forward — its prompt and its generated tokens but the last, as
speculators' connector defines it (``request.all_token_ids[:-1]``) — from one generation. Requests of different
lengths run concurrently (mixed prefill and decode steps, chunked prefill in 32-token steps), beside one that asks
for its prompt only; each file must equal HF transformers' states of exactly those tokens (greedy), TP=1 and TP=2."""

from __future__ import annotations

import fcntl
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from connector_support import LAYERS, VLLM_ARGS, load, serve
from server import Server

from hscapture import runtime_env

pytestmark = [pytest.mark.integration, pytest.mark.newest]


def ask(server, prompt: list[int], max_tokens: int, outputs: bool) -> tuple[list[int], list[int], Path]:
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    body |= {"ignore_eos": True, "return_token_ids": True}
    if outputs:
        body["kv_transfer_params"] = {"include_output_tokens": True}
    status, answer = server.post("/v1/completions", body, timeout=300)
    assert status == 200, answer
    generated = list(answer["choices"][0]["token_ids"])
    path = Path(answer["kv_transfer_params"]["hidden_states_path"])
    with open(str(path) + ".lock", "rb") as lock:  # held from the request's first step until the file is whole
        fcntl.flock(lock, fcntl.LOCK_EX)
    return prompt, generated, path


@pytest.mark.parametrize("tp", [1, 2])
def test_prompt_and_generated_tokens_equal_hf(tmp_path, tiny_model, tp):
    from hscapture.testing import reference

    model = tiny_model("llama", "float32")
    rng = random.Random(7 + tp)
    prompts = [[rng.randrange(4, 1000) for _ in range(rng.randint(3, 70))] for _ in range(5)]
    lengths = [1, 4, 9, 17, 6]
    server, stage = serve(tmp_path, model, "file", tp=tp)
    with server, ThreadPoolExecutor(5) as pool:
        # The last one asks for its prompt only: its file holds the prompt's states, as before.
        jobs = [pool.submit(ask, server, p, n, k < 4) for k, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
        results = [j.result() for j in jobs]
    expected = []
    for k, (prompt, generated, path) in enumerate(results):
        assert len(generated) == lengths[k]
        tokens = prompt + generated[:-1] if k < 4 else prompt
        got = load(path)
        assert got["token_ids"].tolist() == tokens, f"request {k}: token ids"
        assert tuple(got["hidden_states"].shape) == (len(tokens), len(LAYERS), 128)
        expected.append((tokens, got["hidden_states"]))
    ref = reference.compute_subprocess(model, [t for t, _ in expected], LAYERS, "before", tmp_path / "ref")
    for k, ((_tokens, ours), theirs) in enumerate(zip(expected, ref, strict=True)):
        theirs = theirs.float()
        err = torch.linalg.vector_norm(ours - theirs, dim=-1) / torch.linalg.vector_norm(theirs, dim=-1)
        assert float(err.max()) < 1e-4, f"request {k}: {float(err.max()):.2e} from HF at position {int(err.argmax())}"


@pytest.mark.parametrize("tp", [1, 2])
def test_capture_changes_no_generated_token(tmp_path, tiny_model, tp):
    """vLLM's own extraction once changed generated tokens when turned on. Greedy, 40 tokens per request, one
    request at a time (so both servers compute the same batches): the capturing server (prompt and response, and
    prompt only) generates exactly the tokens of the same server without capture."""
    model = tiny_model("llama", "float32")
    rng = random.Random(31 + tp)
    prompts = [[rng.randrange(4, 1000) for _ in range(rng.randint(5, 60))] for _ in range(3)]
    server, _stage = serve(tmp_path, model, "file", tp=tp)
    with server:
        on = [ask(server, p, 40, outputs=k < 2)[1] for k, p in enumerate(prompts)]
    args = [*VLLM_ARGS, "--tensor-parallel-size", str(tp)] + (
        ["--distributed-executor-backend", "mp"] if tp > 1 else []
    )
    plain = Server(tmp_path, model, *args, env=runtime_env.cpu_defaults(tp), name=f"plain-tp{tp}")
    with plain:
        off = []
        for p in prompts:
            body = {"model": model, "prompt": p, "max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
            status, answer = plain.post("/v1/completions", {**body, "return_token_ids": True}, timeout=300)
            assert status == 200, answer
            off.append(list(answer["choices"][0]["token_ids"]))
    assert [len(t) for t in on] == [40, 40, 40]
    assert on == off, "the capture changed generated tokens"
