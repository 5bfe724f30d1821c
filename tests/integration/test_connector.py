"""Today's speculators pipeline, unchanged, on an hscapture server: ``vllm serve`` with ``--worker-cls
hscapture.worker.CaptureWorker`` and the ``HscaptureConnector`` KV connector, driven by speculators 0.9.0's own
``generate-offline-data`` CLI (concurrency 4, chunked prefill forced by 32-token steps, ``--validate-outputs``),
its files read by speculators' ``FileTransfer``/``FP8Transfer`` and its training data loader. The files must equal
hscapture's offline ``extract`` of the same dataset and HF transformers' states: bit for bit where the two runs
compute the same steps (``--max-num-seqs 1``: one request per step, each chunked the same way; ``fp8``: its codes
and scales are speculators' quantization of those states), within float32 noise where requests share steps
differently (TP=2, interleaved)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from connector_support import (
    LAYERS,
    ROWS,
    SEQUENTIAL,
    client_failure,
    connector,
    extract,
    generate,
    hscapture_cli,
    load,
    serve,
    speculators,
)

from hscapture import runtime_env

pytestmark = pytest.mark.integration


def _check_stage_empty(stage: Path) -> None:
    """The client moved every file away and removed every lock: nothing is left behind."""
    left = sorted(p.name for p in stage.iterdir()) if stage.exists() else []
    assert left == [], f"left in the staging directory: {left[:10]}"


def _check_file_run(out: Path, ids, offline: Path, exact: bool) -> None:
    for i, row in enumerate(ids):
        got, ref = load(out / f"hs_{i}.safetensors"), load(offline / "hidden_states" / f"hs_{i}.safetensors")
        assert got["token_ids"].tolist() == row, f"sample {i}: token ids"
        g, r = got["hidden_states"], ref["hidden_states"]
        assert g.dtype == torch.float32 and tuple(g.shape) == (len(row), 3, 128)
        if exact:
            assert torch.equal(g, r), f"sample {i} differs from the offline capture"
        else:
            err = float((torch.linalg.vector_norm(g - r, dim=-1) / torch.linalg.vector_norm(r, dim=-1)).max())
            assert err < 1e-5, f"sample {i} differs from the offline capture by {err:.2e} (float32 noise is ~1e-7)"


TRAINING = """
import json, sys, torch
from pathlib import Path
from hs_connectors import FileTransfer, FP8Transfer
from speculators.train.data import ArrowDataset
from speculators.train.dataloader import _setup_dataloader
from speculators.models.eagle3.data import shift_batch
from speculators.data_generation.offline import check_hidden_states
data, hs, kind = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
transfer = (FP8Transfer if kind == "fp8" else FileTransfer)(hs)
ds = ArrowDataset(max_len=256, datapath=data, transfer=transfer, on_missing="raise", train_ratio=1.0, split="train")
out = {"n": len(ds), "dtypes": sorted({str(transfer.get_cached(i)["hidden_states"].dtype) for i in range(len(ds))})}
for i in range(len(ds)):
    s = transfer.get_cached(i)
    check_hidden_states(s, ds.data[i]["input_ids"].tolist())
dl = _setup_dataloader(ds, total_seq_len=256, hidden_size=128, num_workers=0, num_target_layers=2, preprocess=shift_batch)
batch = next(iter(dl))
out["batch"] = {k: list(v.shape) for k, v in batch.items() if hasattr(v, "shape")}
print(json.dumps(out))
"""


def _train_reads(data: Path, hs: Path, kind: str) -> dict:
    """speculators' training side reads the files: its transfer, its validation and its data loader's first batch."""
    env = {**os.environ, "PYTHONPATH": str(speculators())}
    r = subprocess.run(
        [sys.executable, "-c", TRAINING, str(data), str(hs), kind], capture_output=True, text=True, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.newest
def test_file_server_equals_the_offline_capture_and_hf(prepared):
    from hscapture.testing import reference

    model, root, data, ids, offline = prepared
    server, stage = serve(root, model, "file", extra=SEQUENTIAL)
    out = root / "served-file"
    with server:
        r = generate(server, data, out, validate=True)
    assert r.returncode == 0, client_failure(r) + server.log()
    assert sorted(p.name for p in out.iterdir()) == sorted(f"hs_{i}.safetensors" for i in range(ROWS))
    _check_stage_empty(stage)
    _check_file_run(out, ids, offline, exact=True)
    ref = reference.compute_subprocess(model, [ids[0], ids[5]], LAYERS, "before", root / "ref")
    for k, i in enumerate((0, 5)):
        ours = load(out / f"hs_{i}.safetensors")["hidden_states"]
        err = torch.linalg.vector_norm(ours - ref[k].float(), dim=-1) / torch.linalg.vector_norm(ref[k].float(), dim=-1)
        assert float(err.max()) < 1e-4, f"sample {i} differs from HF transformers by {float(err.max()):.2e}"
    seen = _train_reads(data, out, "file")
    assert seen["n"] == ROWS and seen["dtypes"] == ["torch.float32"]
    assert seen["batch"]["hidden_states"][-1] == 2 * 128, seen


@pytest.mark.newest
def test_fp8_server_stores_speculators_quantization_of_the_same_states(prepared):
    from support import speculators_path

    sys.path.insert(0, str(speculators_path("0.9.0")))
    try:
        from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8
    finally:
        sys.path.pop(0)
    model, root, data, ids, offline = prepared
    server, stage = serve(root, model, "fp8", extra=SEQUENTIAL)
    out = root / "served-fp8"
    with server:
        # speculators 0.9.0's --validate-outputs cannot pass fp8 files (torch.aminmax has no float8 kernel): its
        # online path validates the dequantized states, as _train_reads does below.
        r = generate(server, data, out, validate=False)
    assert r.returncode == 0, client_failure(r) + server.log()
    _check_stage_empty(stage)
    for i, row in enumerate(ids):
        got = load(out / f"hs_{i}.safetensors")
        assert got["token_ids"].tolist() == row
        states = load(offline / "hidden_states" / f"hs_{i}.safetensors")["hidden_states"]
        codes, scales = quantize_tensor_to_fp8(states)  # speculators' own quantizer on the float32 capture
        assert got["hidden_states"].dtype == torch.float8_e4m3fn and got["hidden_states_scales"].shape == (
            len(row),
            1,
            1,
        )
        assert torch.equal(got["hidden_states"].view(torch.uint8), codes.view(torch.uint8)), f"sample {i}: codes"
        assert torch.equal(got["hidden_states_scales"], scales), f"sample {i}: scales"
        deq = dequantize_fp8_tensor(got["hidden_states"], got["hidden_states_scales"]).float()
        # Within the fp8 step: half an e4m3 ulp of each value (2^-4 relative), or of the scale's denormals.
        bound = states.abs() * (2**-4 + 2**-7) + got["hidden_states_scales"].float() * 2**-9
        assert bool(((deq - states).abs() <= bound).all()), f"sample {i}: dequantized beyond the fp8 step"
    seen = _train_reads(data, out, "fp8")
    assert seen["n"] == ROWS and seen["dtypes"] == ["torch.bfloat16"], seen


def test_fp8_extract_is_verified_resumed_and_loaded_dequantized(prepared):
    """`extract --format fp8`: speculators' quantization of the float32 capture; `verify` checks it (a damaged scale
    is named), `--resume` recaptures the damaged file, `load_sample` dequantizes as FP8Transfer does."""
    from hscapture import load_sample

    model, root, data, ids, offline = prepared
    out = root / "offline-fp8"
    r = extract(model, data, out, "--format", "fp8", "--vllm-arg", "max_num_seqs=1")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    m = json.loads((out / "manifest.json").read_text())
    assert (m["sample_format"], m["dtype"]) == ("fp8", "float8_e4m3fn")
    for i in (0, 9):
        st = load(out / "hidden_states" / f"hs_{i}.safetensors")
        ref = load(offline / "hidden_states" / f"hs_{i}.safetensors")["hidden_states"]
        s = load_sample(out / "hidden_states" / f"hs_{i}.safetensors")
        assert s["stored"] == "float8_e4m3fn" and s["hidden_states"].dtype == torch.bfloat16
        deq = (st["hidden_states"].to(torch.bfloat16) * st["hidden_states_scales"].to(torch.bfloat16)).float()
        assert torch.equal(s["hidden_states"].float(), deq), "FP8Transfer's dequantization"
        # Within the fp8 step: half an e4m3 ulp (2^-4 relative) or of its denormals, plus bf16's roundings (2^-8).
        bound = ref.abs() * (2**-4 + 2**-7) + st["hidden_states_scales"].float() * 2**-9
        assert bool(((deq - ref).abs() <= bound).all()), f"sample {i}: dequantized beyond the fp8 step"
    v = hscapture_cli("verify", out)
    assert v.returncode == 0 and "OK" in v.stdout, v.stdout + v.stderr
    victim = out / "hidden_states" / "hs_4.safetensors"
    good = victim.read_bytes()
    header = 8 + int.from_bytes(good[:8], "little")
    at = header + json.loads(good[8:header])["hidden_states_scales"]["data_offsets"][0]
    victim.write_bytes(good[:at] + bytes(4) + good[at + 4 :])  # token 0's scale: 0.0
    v = hscapture_cli("verify", out)
    assert v.returncode != 0 and "hs_4" in v.stdout + v.stderr and "scale" in v.stdout + v.stderr, v.stdout + v.stderr
    r = extract(model, data, out, "--format", "fp8", "--resume", "--vllm-arg", "max_num_seqs=1")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert victim.read_bytes() == good, "the damaged file was recaptured, bit for bit"
    assert hscapture_cli("verify", out).returncode == 0


@pytest.mark.newest
def test_tp2_server_with_a_slow_disk_holds_each_response_s_lock(prepared):
    """TP=2, requests interleaved in steps, every file written 1.5 s late and the first one only once the test lets
    the disk go on: the response names a path whose lock is already held (so a client that waits for it reads a whole
    file), and speculators' CLI gets every sample right."""
    model, root, data, ids, offline = prepared
    hold = root / "disk-stalled"
    hold.touch()
    env = {"HSCAPTURE_TEST_STAGING_DELAY_MS": "1500", "HSCAPTURE_TEST_STAGING_HOLD": str(hold)}
    server, stage = serve(root, model, "file", tp=2, env=env)
    out = root / "served-tp2"
    with server:
        try:
            probe = [5, 6, 7, 8, 9, 10, 11]
            body = server.complete(probe)
            path = Path(body["kv_transfer_params"]["hidden_states_path"])
            assert path.parent == stage and not path.exists(), "the response came before the file (the disk is stalled)"
            with open(str(path) + ".lock", "rb") as lock:
                with pytest.raises(BlockingIOError):
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by the writing worker
                hold.unlink()  # the disk goes on
                t = time.time()
                fcntl.flock(lock, fcntl.LOCK_EX)  # as speculators' client waits
                assert path.exists(), f"the lock was released {time.time() - t:.1f} s later without the file"
            s = load(path)
            assert s["token_ids"].tolist() == probe and tuple(s["hidden_states"].shape) == (len(probe), 3, 128)
            path.unlink()
            Path(str(path) + ".lock").unlink()
        finally:
            hold.unlink(missing_ok=True)  # ended: the server is not left stalled
        r = generate(server, data, out, validate=True)
    assert r.returncode == 0, client_failure(r) + server.log()
    _check_stage_empty(stage)
    _check_file_run(out, ids, offline, exact=False)


def test_a_disk_slower_than_the_server_delays_responses_not_files(prepared):
    """At the disk wall the server's answers must not run ahead of its files: speculators' client waits 10 s for a
    file's lock, then fails the sample (seen on the H200 with DeepSeek-V3-width bf16 files at 1.3 GB/s). Here one
    writer thread writes each file 3 s late and no finished sample may wait for its file when a step ends
    (HSCAPTURE_STAGING_BACKLOG_MIB=0): the steps wait for the writer, so every response's file is there in time.
    With an unbounded backlog the same run loses samples to the client's timeout (the fifth answer's file is 12 s
    behind it)."""
    model, root, data, ids, offline = prepared
    env = {
        "HSCAPTURE_TEST_STAGING_DELAY_MS": "3000",
        "HSCAPTURE_WRITER_THREADS": "1",
        "HSCAPTURE_STAGING_BACKLOG_MIB": "0",
    }
    server, stage = serve(root, model, "file", env=env, extra=["--max-num-seqs", "4"])
    out = root / "served-slow-disk"
    with server:
        t = time.time()
        r = generate(server, data, out, False, "--max-samples", "8")
    assert r.returncode == 0, client_failure(r) + server.log()
    assert sorted(p.name for p in out.iterdir()) == [f"hs_{i}.safetensors" for i in range(8)]
    assert time.time() - t >= 8 * 3, "every file was written 3 s late, one at a time"
    _check_stage_empty(stage)


@pytest.mark.newest
def test_a_request_whose_capture_fails_gets_an_error_not_a_path(prepared):
    from faulty import MARKER

    model, root, data, ids, offline = prepared
    server, stage = serve(root, model, "file", worker="faulty.NaNInMarkedPromptWorker")
    with server:
        ok = server.complete([5, 6, 7])
        assert Path(ok["kv_transfer_params"]["hidden_states_path"]).parent == stage
        status, body = server.post("/v1/completions", {"model": model, "prompt": [MARKER, 5, 6, 7], "max_tokens": 1})
        # vLLM answers a dead engine with an error object (its HTTP status varies by version), never a completion.
        assert "error" in body and "choices" not in body and "kv_transfer_params" not in json.dumps(body), (
            status,
            body,
        )
        assert "NonFiniteError" in server.log() or "non-finite" in server.log(), server.log()
    poisoned = [p for p in stage.iterdir() if p.name.endswith(".safetensors")]
    assert len(poisoned) == 1, "only the healthy request's file exists"


LLM_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
stage, model = sys.argv[1], sys.argv[2]
llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=256, max_num_batched_tokens=32, max_num_seqs=1,
          worker_cls="hscapture.worker.CaptureWorker",
          additional_config={"hscapture": {"layers": [1, 2, 4], "convention": "before"}},
          kv_transfer_config=KVTransferConfig(**json.loads(sys.argv[3])))
outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[4])], SamplingParams(max_tokens=1))
print("RESULT " + json.dumps([[o.prompt_token_ids, (o.kv_transfer_params or {}).get("hidden_states_path")] for o in outs]))
"""


@pytest.mark.newest
def test_llm_generate_carries_the_same_contract(prepared, tmp_path):
    model, root, data, ids, offline = prepared
    stage = tmp_path / "stage"
    ps = [ids[3], ids[4], ids[7]]
    env = {**os.environ, **runtime_env.cpu_defaults(1)}
    cmd = [sys.executable, "-c", LLM_SCRIPT, str(stage), model, connector(stage, "file"), json.dumps(ps)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT ") :])
    for (prompt, path), i in zip(got, (3, 4, 7), strict=True):
        assert prompt == ids[i] and path is not None
        with open(path + ".lock", "rb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
        s, ref = load(Path(path)), load(offline / "hidden_states" / f"hs_{i}.safetensors")
        assert s["token_ids"].tolist() == ids[i] and torch.equal(s["hidden_states"], ref["hidden_states"])


def test_sigterm_writes_the_queued_files_or_fails_their_requests(tmp_path, tiny_model):
    """SIGTERM to a server whose disk is slow (each file 1.5 s late), right after it answered 8 requests: every
    answered path ends as its whole file (written before the worker exits) or as nothing, never as a lock file
    that promises a file no process will write."""
    import signal

    model = tiny_model("llama", "float32")
    server, stage = serve(tmp_path, model, "file", env={"HSCAPTURE_TEST_STAGING_DELAY_MS": "1500"})
    prompts = [[7, 8, 9, 10 + i] for i in range(8)]
    with server:
        paths = [Path(server.complete(p)["kv_transfer_params"]["hidden_states_path"]) for p in prompts]
        assert any(not p.exists() for p in paths), "the disk was not slow: nothing was queued at the signal"
        os.killpg(server.proc.pid, signal.SIGTERM)
        server.proc.wait(timeout=120)
    written = 0
    for p, ids in zip(paths, prompts, strict=True):
        lock = Path(str(p) + ".lock")
        if p.exists():
            assert load(p)["token_ids"].tolist() == ids, f"{p.name}: not the request's own states"
            written += 1
        else:
            assert not lock.exists(), f"{p.name}: a lock file promises a file no process will write:\n{server.log()}"
    assert written > 0, "the worker wrote none of the queued files before it exited:\n" + server.log()
    assert not [f for f in os.listdir(stage) if f.endswith(".partial")], "partial files left behind"
