"""The KV-connector face on the GPU, through ``LLM.generate`` with vLLM's defaults (the engine ``vllm serve`` runs:
torch.compile and CUDA graphs, on vLLM's default model runner): ``file`` and ``fp8``
(quantized on the device, and in the writer threads), with vLLM's engine process and with the engine in the caller's
process. 72 prompts of 3..300 tokens, chunked prefill (96-token steps), one ``generate`` per 16 prompts as
speculators' clients send them; after each ``generate`` the driver does what the client does (waits for each file's
lock, reads it, removes it) under a deadline, so a file that never appears fails the test instead of hanging it.

Every file is checked against hscapture's offline capture of the same prompts with one request per step
(``max_num_seqs=1`` on both sides: the same steps): ``file`` within float32 noise (two engines compiled apart may
sum in another order; bit-equal samples are counted), ``fp8`` within fp8's rounding of speculators'
``quantize_tensor_to_fp8`` of those states, with 99.9 % of its codes equal. A second run with requests sharing steps
(16 per ``generate``, fp8 on the device) checks every file whole, in time, and within fp8's rounding of the same states.
Prompt and response captured in one pass (``include_output_tokens``, decode replayed from FULL CUDA graphs) equal
HF transformers on the same tokens, and change no generated token."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from client_script import HELPERS
from test_fp8_device import _fp8_utils  # speculators' own quantizer, or a skip naming why

pytest.importorskip("vllm")
pytestmark = pytest.mark.gpu

LAYERS = [1, 2, 4]  # before convention: inputs of layers 1 and 2, and the final output (N = 4)
STEP_TOKENS = 96
DEADLINE_S = 240

_DRIVER = r"""
import fcntl, json, os, shutil, sys, time
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
if __name__ == "__main__":
    model, stage, keep, fmt, prompts_file, seqs = sys.argv[1:7]
    prompts = json.load(open(prompts_file))
    llm = LLM(model=model, dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.3,
              max_model_len=512, max_num_batched_tokens=STEP_TOKENS, max_num_seqs=int(seqs),
              enable_prefix_caching=False, seed=0, worker_cls="hscapture.worker.CaptureWorker",
              additional_config={"hscapture": {"layers": LAYERS, "convention": "before"}},
              kv_transfer_config=KVTransferConfig(kv_connector="HscaptureConnector",
                  kv_connector_module_path="hscapture.connector", kv_role="kv_producer",
                  kv_connector_extra_config={"shared_storage_path": stage, "format": fmt}))
    sp = SamplingParams(max_tokens=1, detokenize=False)
    deadline = time.time() + DEADLINE_S
    for b in range(0, len(prompts), 16):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[b:b + 16]], sp, use_tqdm=False)
        for i, o in enumerate(outs):
            path = (o.kv_transfer_params or {}).get("hidden_states_path")
            assert path, f"prompt {b + i}: no hidden_states_path in {o.kv_transfer_params}"
            with open(path + ".lock", "rb") as f:  # as speculators' client: the lock is free once the file is whole
                while True:
                    try:
                        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.time() > deadline:
                            print(f"TIMEOUT prompt {b + i}: {path} still locked after {DEADLINE_S} s", flush=True)
                            os._exit(3)
                        time.sleep(0.01)
            shutil.move(path, os.path.join(keep, f"{b + i}.safetensors"))
            os.unlink(path + ".lock")
    print("DRIVER_DONE", flush=True)
"""


def _prompts() -> list[list[int]]:
    rng = random.Random(21)
    return [[rng.randrange(4, 1000) for _ in range(rng.randint(3, 300))] for _ in range(72)]


def _drive(tmp: Path, model: str, fmt: str, env: dict, seqs: int, name: str) -> Path:
    stage, keep = tmp / f"stage-{name}", tmp / f"keep-{name}"
    stage.mkdir()
    keep.mkdir()
    script = tmp / "driver.py"
    script.write_text(f"LAYERS = {LAYERS}\nSTEP_TOKENS = {STEP_TOKENS}\nDEADLINE_S = {DEADLINE_S}\n" + _DRIVER)
    (tmp / "prompts.json").write_text(json.dumps(_prompts()))
    env = {**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "HSCAPTURE_DEVICE_PATH": "required", **env}
    cmd = [sys.executable, str(script), model, str(stage), str(keep), fmt, str(tmp / "prompts.json"), str(seqs)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=DEADLINE_S + 180)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{name}: the driver did not finish (a hang): {(e.stdout or b'')[-2000:]!r}")
    if r.returncode != 0 or "DRIVER_DONE" not in r.stdout:
        pytest.fail(f"{name} failed:\n" + "\n".join((r.stdout + r.stderr).splitlines()[-30:]))
    assert sorted(os.listdir(stage)) == [], f"{name}: left in the staging directory"
    return keep


@pytest.fixture(scope="module")
def offline(tmp_path_factory, tiny_model):
    """hscapture's offline capture, one request per step with the same chunking: the states every file must equal."""
    from hscapture import load_sample
    from hscapture.cli.extract import ExtractOptions, run_extract

    tmp = tmp_path_factory.mktemp("offline")
    model = tiny_model("llama", "float32")
    rep = run_extract(
        ExtractOptions(
            model=model,
            prompts=_prompts(),
            out=str(tmp / "out"),
            convention="before",
            layers=LAYERS,
            tp=1,
            dtype="float32",
            max_num_batched_tokens=STEP_TOKENS,
            progress=False,
            max_model_len=512,
            durable=False,
            compile=True,  # vLLM's defaults, as the connector's engine: the same kernels, so the same bits
            llm_kwargs={"gpu_memory_utilization": 0.3, "max_num_seqs": 1},
        )
    )
    assert rep.layer_ids == LAYERS
    files = [tmp / "out" / "hidden_states" / f"hs_{i}.safetensors" for i in range(len(_prompts()))]
    return model, [load_sample(f)["hidden_states"] for f in files]


@pytest.mark.parametrize(
    "fmt,env",
    [
        ("file", {}),
        ("fp8", {}),
        ("fp8", {"HSCAPTURE_FP8_ON_DEVICE": "0"}),
        ("fp8", {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
    ],
    ids=["file", "fp8-device", "fp8-writer", "fp8-device-engine-in-process"],
)
def test_connector_files_equal_the_offline_capture(tmp_path, offline, fmt, env):
    from safetensors.torch import load_file

    from hscapture.testing.compare import compare

    model, want = offline
    keep = _drive(tmp_path, model, fmt, env, seqs=1, name=fmt)
    prompts = _prompts()
    q = _fp8_utils() if fmt == "fp8" else None
    got, ref, same, codes_same, codes_all = [], [], 0, 0, 0
    for i, p in enumerate(prompts):
        t = load_file(keep / f"{i}.safetensors")
        assert t["token_ids"].tolist() == p, f"prompt {i}: token ids"
        if q is None:
            assert t["hidden_states"].dtype == want[i].dtype and t["hidden_states"].shape == want[i].shape, (
                f"prompt {i}"
            )
            same += int(torch.equal(t["hidden_states"], want[i]))
            got.append(t["hidden_states"])
            ref.append(want[i])
            continue
        codes, scales = q.quantize_tensor_to_fp8(want[i])
        assert t["hidden_states"].dtype == torch.float8_e4m3fn and tuple(t["hidden_states"].shape) == tuple(codes.shape)
        same += int(torch.equal(t["hidden_states"].view(torch.uint8), codes.view(torch.uint8)))
        codes_same += int((t["hidden_states"].view(torch.uint8) == codes.view(torch.uint8)).sum())
        codes_all += codes.numel()
        got.append(t["hidden_states"].to(torch.float32) * t["hidden_states_scales"].to(torch.float32))
        ref.append(codes.to(torch.float32) * scales.float())
        _within_the_fp8_step(i, got[-1], want[i], t["hidden_states_scales"])
    # Two engines compile the model separately (the connector is part of vLLM's compile-cache key), and Inductor's
    # autotuned reductions may sum in another order: float32 noise, not a wrong row (a row of another token or step
    # is off by its whole norm). Bit-equal samples are counted, not required.
    cmp = compare(got, ref)
    print(
        f"CONNECTOR_VS_OFFLINE {fmt} {env}: {same}/{len(prompts)} samples bit-equal, worst relative error "
        f"{cmp.worst:.2e} at {cmp.where}" + (f", fp8 codes equal {codes_same / codes_all:.5f}" if q else "")
    )
    if q is None:
        assert cmp.ok(1e-4), f"worst relative error {cmp.worst:.2e} at (sample, token, layer) {cmp.where}"
    else:  # each value was held to the fp8 step above; a code flipped by the noise may move a row's norm by more
        assert codes_same >= 0.999 * codes_all, f"only {codes_same}/{codes_all} fp8 codes equal speculators' quantizer"


def _within_the_fp8_step(k: int, deq: torch.Tensor, states: torch.Tensor, scales: torch.Tensor) -> None:
    """Each dequantized value within the fp8 step of the float32 state it stands for: half an e4m3 ulp (2^-4
    relative) or of the scale's denormals, plus the float32 noise between two engines compiled apart (1e-4 of the
    row's norm, what the ``file`` variant holds). A code the noise moved across a rounding boundary stays inside; a
    row of another token or step, or a wrong scale, is off by about its own size."""
    states = states.float()
    noise = 1e-4 * torch.linalg.vector_norm(states, dim=-1, keepdim=True)
    bound = states.abs() * (2**-4 + 2**-7) + scales.float() * 2**-9 + noise
    over = (deq - states).abs() > bound
    assert not bool(over.any()), f"sample {k}: {int(over.sum())} values beyond the fp8 step of the offline states"


def test_connector_with_shared_steps_answers_every_request_in_time(tmp_path, offline):
    """Requests share steps (16 per generate, chunked; fp8 quantized on the device, where the hang was): every file
    whole and in time, the same states within float32 and fp8 noise."""
    from safetensors.torch import load_file

    from hscapture.testing.compare import compare

    model, want = offline
    keep = _drive(tmp_path, model, "fp8", {}, seqs=16, name="fp8-shared")
    got = []
    for i, p in enumerate(_prompts()):
        t = load_file(keep / f"{i}.safetensors")
        assert t["token_ids"].tolist() == p, f"prompt {i}: token ids"
        got.append(t["hidden_states"].to(torch.float32) * t["hidden_states_scales"].to(torch.float32))
        _within_the_fp8_step(i, got[-1], want[i], t["hidden_states_scales"])
    q = _fp8_utils()
    ref = [c.to(torch.float32) * s for c, s in (q.quantize_tensor_to_fp8(w) for w in want)]
    cmp = compare(got, ref)  # the states differ by float32 noise, so a rare code lands one e4m3 step away
    print(f"CONNECTOR_SHARED_STEPS fp8: worst relative error {cmp.worst:.2e} at {cmp.where}")


_TOKENS = r"""
import json, os, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    model, stage, keep, fmt, prompts_file = sys.argv[1:6]  # fmt: "off" (no capture), "file" or "fp8"
    capture = fmt != "off"
    prompts = json.load(open(prompts_file))[:12]
    kw = dict(model=model, dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.3,
              max_model_len=512, max_num_batched_tokens=STEP_TOKENS, enable_prefix_caching=False, seed=0)
    if capture:
        kw |= capture_kwargs(stage, fmt)
    llm = LLM(**kw)
    out = []
    for k, p in enumerate(prompts):  # one request at a time: the same batches with and without capture
        extra = {"kv_transfer_params": {"include_output_tokens": True}} if capture and k % 2 == 0 else None
        sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, detokenize=False, extra_args=extra)
        (o,) = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
        out.append(list(o.outputs[0].token_ids))
        path = (o.kv_transfer_params or {}).get("hidden_states_path") if capture else None
        if path:
            take(path, os.path.join(keep, f"{k}.safetensors"))
    print("TOKENS " + json.dumps(out), flush=True)
"""


def test_capture_changes_no_generated_token_and_captures_the_response(tmp_path, offline):
    """Greedy, 40 tokens per request, one request at a time: with capture (prompt and response for every other
    request, prompt only for the rest) the engine generates exactly the tokens it generates without; the response's
    rows (decode steps replayed from FULL CUDA graphs) equal HF transformers on prompt and response. A third run
    stores fp8 quantized on the device (a growing sample, a scale per token): the same tokens generated, and its
    codes equal speculators' quantizer of the file run's states."""
    from safetensors.torch import load_file

    from hscapture.testing import reference
    from hscapture.testing.compare import compare

    model, _ = offline
    script = tmp_path / "tokens.py"
    script.write_text(f"LAYERS = {LAYERS}\nSTEP_TOKENS = {STEP_TOKENS}\n" + HELPERS + _TOKENS)
    (tmp_path / "prompts.json").write_text(json.dumps(_prompts()))
    env = {**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "HSCAPTURE_DEVICE_PATH": "required"}
    got = {}
    for capture in ("off", "file", "fp8"):  # fp8: quantized on the device, a growing sample token by token
        (tmp_path / f"stage-{capture}").mkdir()
        (tmp_path / f"keep-{capture}").mkdir()
        cmd = [
            sys.executable,
            str(script),
            model,
            str(tmp_path / f"stage-{capture}"),
            str(tmp_path / f"keep-{capture}"),
        ]
        cmd.append(capture)
        try:
            r = subprocess.run(
                cmd + [str(tmp_path / "prompts.json")], capture_output=True, text=True, env=env, timeout=300
            )
        except subprocess.TimeoutExpired as e:  # the engine or a client stuck: show where it was
            tail = ((e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")) + (
                (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            )
            pytest.fail(f"{capture} did not finish in 300 s:\n" + "\n".join(tail.splitlines()[-60:]))
        line = [x for x in r.stdout.splitlines() if x.startswith("TOKENS ")]
        if r.returncode != 0 or not line:
            pytest.fail(f"{capture} failed:\n" + "\n".join((r.stdout + r.stderr).splitlines()[-30:]))
        got[capture] = json.loads(line[-1][len("TOKENS ") :])
    assert [len(t) for t in got["file"]] == [40] * 12
    assert got["file"] == got["off"], "the capture changed generated tokens"
    assert got["fp8"] == got["off"], "the fp8 capture changed generated tokens"
    prompts = _prompts()[:12]
    seqs = [prompts[k] + got["file"][k][:-1] for k in range(0, 12, 2)]  # every token that went through a forward
    files = [load_file(tmp_path / "keep-file" / f"{k}.safetensors") for k in range(0, 12, 2)]
    assert [f["token_ids"].tolist() for f in files] == seqs
    cmp = compare([f["hidden_states"] for f in files], reference.compute(model, seqs, LAYERS, "before"))
    print(f"DECODE_ORACLE prompt + response vs transformers: worst relative error {cmp.worst:.2e} at {cmp.where}")
    assert cmp.ok(5e-3), f"worst relative error {cmp.worst:.2e} at {cmp.where}"
    # fp8: speculators' quantization of the file run's states (the same kernels), a scale per token
    q = _fp8_utils()
    codes_same = codes_all = 0
    for k, f in zip(range(0, 12, 2), files, strict=True):
        t = load_file(tmp_path / "keep-fp8" / f"{k}.safetensors")
        assert t["token_ids"].tolist() == f["token_ids"].tolist(), f"fp8 request {k}: token ids"
        assert tuple(t["hidden_states_scales"].shape) == (len(seqs[k // 2]), 1, 1), f"fp8 request {k}: scales"
        codes, _scales = q.quantize_tensor_to_fp8(f["hidden_states"])
        codes_same += int((t["hidden_states"].view(torch.uint8) == codes.view(torch.uint8)).sum())
        codes_all += codes.numel()
    print(f"DECODE_FP8 prompt + response: fp8 codes equal speculators' quantizer {codes_same / codes_all:.5f}")
    assert codes_same >= 0.999 * codes_all, f"only {codes_same}/{codes_all} fp8 codes equal speculators' quantizer"
