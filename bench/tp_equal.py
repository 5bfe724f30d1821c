"""TP=N against TP=1 on real-width models (run on a multi-GPU machine with vLLM):

    VLLM_WORKER_MULTIPROC_METHOD=spawn python3 bench/tp_equal.py --shapes llama8b,dsv3 --tp 2 --out /tmp/tpeq

For each shape: a model of that width (fewer layers and, for DeepSeek-V3, fewer routed experts, so that it
is built in seconds) gets random weights from a fixed seed and is saved once; `hscapture extract` then
captures the same prompts at TP=1 and at TP=N from those weights, and every token of every sample is compared
(relative error per token and layer; bf16 with a different all-reduce order, so not bit-equal). Prints one
line per shape and exits non-zero when a shape exceeds --tol. `--dtype float32` runs both captures in float32
(the bf16 weights upcast): where bf16 differences come from rounding (e.g. top-k expert choices flipped in MoE
layers), they shrink to float32 noise there; a mis-attribution would not.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gpu import LAYERS, SHAPES  # noqa: E402

REDUCED = {
    "llama8b": {"num_hidden_layers": 4},
    "dsv3": {"num_hidden_layers": 4, "n_routed_experts": 16, "n_group": 4, "topk_group": 2},
}
IDS = {"llama8b": [0, 1, 2, 3], "dsv3": [0, 1, 2, 3]}


def build(name: str, mdir: Path) -> None:
    if (mdir / "config.json").exists():
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {**SHAPES[name], **REDUCED[name]}
    mdir.mkdir(parents=True, exist_ok=True)
    (mdir / "src-config.json").write_text(json.dumps(cfg))
    conf = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(conf, torch_dtype=torch.bfloat16)
    model.save_pretrained(mdir)
    del model  # vLLM, started next, checks that the GPU memory it is to take is free
    torch.cuda.empty_cache()
    c = json.loads((mdir / "config.json").read_text())
    c.update({k: cfg[k] for k in ("topk_method", "scoring_func") if k in cfg})
    (mdir / "config.json").write_text(json.dumps(c, indent=1))


def capture(mdir: Path, out: Path, tp: int, prompts: Path, ids: list[int], dtype: str, runner: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "hscapture",
        "extract",
        "--model",
        str(mdir),
        "--input",
        str(prompts),
        "--out",
        str(out),
        "--convention",
        "after",
        "--layers",
        ",".join(map(str, ids)),
        "--tp",
        str(tp),
        "--dtype",
        dtype,
        "--max-num-batched-tokens",
        "2048",
        "--no-fsync",
        "--overwrite",
    ]
    env = {**os.environ, "HSCAPTURE_DEVICE_PATH": "required"}
    if runner == "v1":  # the V1 runner, where this vLLM still has it; by default the runner vLLM picks
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(
            f"TP={tp} capture of {mdir.name} failed:\n" + "\n".join((r.stdout + r.stderr).splitlines()[-30:])
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama8b,dsv3")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tol", type=float, default=3e-2)
    ap.add_argument("--out", default="/tmp/tpeq")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the model's dtype in vLLM")
    ap.add_argument(
        "--runner", default="default", choices=["default", "v1"], help="vLLM's model runner: its default, or V1"
    )
    args = ap.parse_args()
    from hscapture import load_sample
    from hscapture.testing.compare import compare

    out = Path(args.out)
    bad = []
    for name in args.shapes.split(","):
        mdir = out / f"model-{name}"
        build(name, mdir)
        vocab = SHAPES[name]["vocab_size"]
        rng = random.Random(3)
        lens = [rng.choice([7, 63, 300, 1000, 2500]) + rng.randrange(20) for _ in range(args.prompts)]
        pfile = out / f"prompts-{name}.jsonl"
        pfile.write_text(
            "".join(json.dumps({"token_ids": [rng.randrange(10, vocab) for _ in range(n)]}) + "\n" for n in lens)
        )
        runs = {}
        for tp in (1, args.tp):
            run_dir = out / f"{name}-{args.dtype}-tp{tp}"
            capture(mdir, run_dir, tp, pfile, IDS[name], args.dtype, args.runner)
            runs[tp] = [load_sample(run_dir / "hidden_states" / f"hs_{i}.safetensors") for i in range(args.prompts)]
        import torch

        from hscapture.testing.compare import relative_errors

        errs = torch.cat(
            [
                relative_errors(a["hidden_states"], b["hidden_states"])
                for a, b in zip(runs[args.tp], runs[1], strict=True)
            ]
        )
        for k in range(errs.shape[1]):
            e = errs[:, k]
            print(
                f"TP_EQUAL {name} {args.dtype} layer slot {k} (after-layer id {IDS[name][k]}): worst {float(e.max()):.2e}, "
                f"median {float(e.median()):.2e}, p99 {float(e.quantile(0.99)):.2e}, tokens above {args.tol:g}: "
                f"{int((e > args.tol).sum())} of {e.numel()}",
                flush=True,
            )
        same_tokens = all(
            a["token_ids"].tolist() == b["token_ids"].tolist() for a, b in zip(runs[1], runs[args.tp], strict=True)
        )
        cmp = compare([s["hidden_states"] for s in runs[args.tp]], [s["hidden_states"] for s in runs[1]])
        ok = same_tokens and cmp.ok(args.tol)
        print(
            f"TP_EQUAL {name}: TP={args.tp} vs TP=1, {args.prompts} prompts, {cmp.tokens} tokens x {len(IDS[name])} layers "
            f"(layers {LAYERS[name]} not used: reduced depth), token ids equal {same_tokens}, worst relative error "
            f"{cmp.worst:.2e} at (sample, token, layer) {cmp.where}: {'OK' if ok else 'FAIL'}",
            flush=True,
        )
        if not ok:
            bad.append(name)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
