"""``hscapture`` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import _native
from ..errors import HscaptureError
from ..output.formats import FORMATS


def _ids(s: str) -> list[int]:
    from ..config import layer_ids

    try:
        return list(layer_ids(s))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers in ascending order such as 2,4,5 (slot k holds the k-th), found {s!r}"
        ) from None


def _int(s: str) -> int:
    from ..config import integer

    try:
        return integer(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer such as 4, found {s!r}") from None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="hscapture", description="Capture vLLM prefill hidden states as EAGLE-3 training data."
    )
    sub = ap.add_subparsers(dest="cmd", required=True)

    ex = sub.add_parser("extract", help="capture hidden states for a file of prompts")
    ex.add_argument("--model", required=True, help="local model directory (config.json + weights)")
    ex.add_argument(
        "--input",
        required=True,
        help='JSONL (one {"token_ids": [...]} or {"text": "..."} per line; sample i = line i), or speculators\' '
        "prepared dataset (a datasets save_to_disk directory with input_ids; sample i = row i)",
    )
    ex.add_argument("--tokenizer", default=None, help='tokenizer directory for "text" lines (default: the model\'s)')
    ex.add_argument("--out", required=True, help="output directory (hidden_states/hs_{i}.safetensors, manifest.json)")
    ex.add_argument(
        "--format",
        default=_native.DEFAULTS["format"],
        choices=sorted(FORMATS),
        help="hscapture: hidden_states/hs_{i}.safetensors (speculators' current training); fp8: the same files "
        "with e4m3fn states and per-token scales, half the bytes (speculators' FP8Transfer); legacy: "
        "data_{i}.pt + sample_lengths.json + data_config.json (speculators 0.3/0.4)",
    )
    ex.add_argument(
        "--shard",
        default=None,
        metavar="K/N",
        help="capture only rows i with i %% N == K (file names keep the global i); join with hscapture merge",
    )
    ex.add_argument(
        "--executor",
        default=None,
        help="vLLM's distributed_executor_backend, e.g. ray for TP across nodes (see docs/operations.md)",
    )
    ex.add_argument(
        "--log-every",
        type=float,
        default=30.0,
        help="seconds between progress lines when stdout is not a terminal (0: none)",
    )
    ex.add_argument(
        "--layers", type=_ids, default=None, help="layer ids, e.g. 2,4,5 (default: the convention's usual ids)"
    )
    ex.add_argument(
        "--convention",
        required=True,
        choices=["after", "before"],
        help="after: id i = output of decoder layer i; before: id i = input of layer i (0 = embeddings, N = final)",
    )
    ex.add_argument("--tp", type=_int, default=1, help="tensor-parallel size")
    ex.add_argument("--pp", type=_int, default=1, help="pipeline-parallel size (every stage's layers are captured)")
    ex.add_argument(
        "--compress",
        type=_int,
        default=0,
        metavar="LEVEL",
        help="store states losslessly compressed: byte-plane split + zstd at LEVEL ({}..{}; 1 is fastest and "
        "compressed as well as 3 or 9 on the activations measured); 0 = as they are (default); hscapture's reader and "
        "verify decode them".format(*_native.COMPRESS_LEVELS),
    )
    ex.add_argument(
        "--on-nonfinite",
        default="error",
        choices=["error", "skip"],
        help="a sample with NaN/Inf values: fail with its sample, layer and count (default), or skip it "
        "and list it in the manifest",
    )
    ex.add_argument(
        "--layer-output",
        default="auto",
        choices=["auto", "sum", "hidden"],
        help="what a decoder layer's output is: auto (read from the layer's forward: hidden_states + residual for "
        "vLLM's fused-residual layers, hidden_states alone for layers that return the stream whole); sum or hidden: "
        "every hooked layer so, for layers whose forward hscapture cannot read",
    )
    ex.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="the model's dtype in vLLM"
    )
    ex.add_argument(
        "--store-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="dtype of the stored states (auto: the model's); the residual sum is rounded once into it",
    )
    ex.add_argument(
        "--max-num-batched-tokens", type=_int, default=None, help="tokens per step (smaller forces chunked prefill)"
    )
    ex.add_argument("--max-model-len", type=_int, default=None)
    ex.add_argument("--overwrite", action="store_true", help="replace an existing capture in --out")
    ex.add_argument(
        "--resume",
        action="store_true",
        help="continue an earlier run in --out: its finished samples are kept, the rest captured",
    )
    ex.add_argument(
        "--writer-threads", type=_int, default=None, help="threads writing files (default: one per CPU core, 4 to 16)"
    )
    ex.add_argument("--no-fsync", action="store_true", help="do not fsync files before declaring them done")
    ex.add_argument(
        "--compile",
        action="store_true",
        help="let vLLM run the model with its defaults: torch.compile (the capture is traced into its graph) and, "
        "on CUDA, CUDA graphs (the capture's device launches are recorded into them)",
    )
    ex.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the model directory's own Python code (vLLM's model and config, the tokenizer of \"text\" "
        "prompts), as models such as Kimi-K2 need",
    )
    ex.add_argument(
        "--vllm-arg",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="one of vLLM's engine arguments, passed to vllm.LLM (repeat for more), e.g. "
        "gpu_memory_utilization=0.9, enable_expert_parallel=true, max_num_seqs=64, "
        "kv_cache_dtype=fp8; VALUE is read as JSON when it parses, else as text; checked against "
        "vllm.EngineArgs before vLLM starts",
    )

    de = sub.add_parser("demo", help="run the whole path on a tiny DeepSeek-V3-shaped model and check it against HF")
    de.add_argument("--out", default="hscapture-demo", help="output directory (replaced)")
    de.add_argument("--tp", type=_int, default=2)
    de.add_argument("--max-num-batched-tokens", type=_int, default=64)

    rs = sub.add_parser("run-speculators", help="run a speculators data-generation script unchanged, on hscapture")
    rs.add_argument(
        "--own-extension",
        action="store_true",
        help="keep speculators' own worker extension (only the shims apply; for side-by-side runs)",
    )
    rs.add_argument("script")
    rs.add_argument("args", nargs=argparse.REMAINDER)

    me = sub.add_parser("merge", help="merge the shard directories of one sharded extract into one capture")
    me.add_argument("out", help="new output directory")
    me.add_argument("shards", nargs="+", help="the shard directories (extract --shard k/n), every k once")
    me.add_argument("--move", action="store_true", help="move the files instead of hard-linking them")

    ve = sub.add_parser("verify", help="check a capture directory against its manifest and the contract")
    ve.add_argument("dir")
    ve.add_argument("--model", default=None, help="also recompute samples with HF transformers and compare")
    ve.add_argument("--samples", type=_int, default=2, help="how many samples --model recomputes")
    ve.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="worst relative error --model accepts (default: from the stored dtype and the dtype vLLM ran the model "
        "in: 1e-3 float32, 1e-2 float16, 3e-2 bfloat16)",
    )

    sub.add_parser(
        "launch",
        add_help=False,  # its own parser: `hscapture launch --help`
        help="start vllm serve for speculators (the arguments of its scripts/launch_vllm.py), capturing with hscapture",
    )
    sub.add_parser("version", help="print versions")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:  # speculators' launcher's arguments, vLLM's after them: parsed as it parses them
        from .launch import main as launch

        try:
            return launch(argv[1:])
        except HscaptureError as e:
            print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
    args = parser().parse_args(argv)
    from .extract import quiet_vllm

    try:
        if args.cmd == "extract":
            quiet_vllm()
            from . import vllm_args
            from .extract import ExtractOptions, default_writer_threads, run_extract
            from .inputs import open_input

            tty = sys.stdout.isatty()
            engine = vllm_args.parse(args.vllm_arg)  # before the input is read: a typo costs nothing
            rep = run_extract(
                ExtractOptions(
                    model=args.model,
                    prompts=open_input(args.input, args.model, args.tokenizer, args.trust_remote_code),
                    out=args.out,
                    llm_kwargs=engine,
                    trust_remote_code=args.trust_remote_code,
                    convention=args.convention,
                    layers=args.layers,
                    tp=args.tp,
                    pp=args.pp,
                    on_nonfinite=args.on_nonfinite,
                    layer_output=args.layer_output,
                    compress=args.compress,
                    dtype=args.dtype,
                    store_dtype=args.store_dtype,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    max_model_len=args.max_model_len,
                    overwrite=args.overwrite,
                    resume=args.resume,
                    writer_threads=default_writer_threads() if args.writer_threads is None else args.writer_threads,
                    durable=not args.no_fsync,
                    progress=tty,
                    log_every=0.0 if tty else args.log_every,
                    format=args.format,
                    shard=args.shard,
                    executor=args.executor,
                    input_path=str(Path(args.input).resolve()),
                    compile=args.compile,
                )
            )
            for line in rep.lines():
                print(line)
            return 0
        if args.cmd == "merge":
            from .merge import run_merge

            for line in run_merge(Path(args.out), [Path(d) for d in args.shards], move=args.move).lines():
                print(line)
            return 0
        if args.cmd == "demo":
            quiet_vllm()
            from .demo import run_demo

            return run_demo(Path(args.out).resolve(), tp=args.tp, max_num_batched_tokens=args.max_num_batched_tokens)
        if args.cmd == "run-speculators":
            from .run_speculators import run

            run(
                args.script,
                args.args[1:] if args.args[:1] == ["--"] else args.args,
                use_hscapture=not args.own_extension,
            )
            return 0
        if args.cmd == "verify":
            from .verify import run_verify

            return run_verify(Path(args.dir), args.model, args.samples, args.tolerance)
        if args.cmd == "version":
            from .. import __version__

            print(f"hscapture {__version__}")
            return 0
    except HscaptureError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - vLLM's own failures: its log above has the root cause
        print(
            f"error: {type(e).__name__}: {e}\n(the log above holds vLLM's account of the root cause)", file=sys.stderr
        )
        return 1
    return 1


if __name__ == "__main__":
    sys.exit(main())
