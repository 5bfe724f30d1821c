#!/usr/bin/env python3
"""Run one kernel from each carried vLLM CUDA extension against a torch reference.

Tells which extension (if any) fails to load or run on this GPU, e.g. after the
fatbin blanking that made the payload small. Informative only: exits 0 unless
--strict and something failed. Prints 'KERNELS_JSON {...}' last.
"""
import json
import sys
import traceback

import torch


def check(name, fn, results):
    try:
        err = fn()
        results[name] = {"ok": err is None or err < 5e-2, "max_err": None if err is None else float(err)}
    except Exception as e:  # keep going: report every extension
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:400]}
        traceback.print_exc()
    print(f"[kernels] {name}: {results[name]}", flush=True)


def main():
    dev = "cuda"
    torch.manual_seed(0)
    results = {}
    print("[kernels] torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0),
          "cc", torch.cuda.get_device_capability(0), flush=True)

    def load(mod):
        import importlib

        importlib.import_module(mod)

    for mod in ["vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch", "vllm._flashmla_C",  # 0.26: no _C/_moe_C
                "vllm.vllm_flash_attn._vllm_fa3_C", "vllm.cumem_allocator"]:
        check(f"import {mod}", lambda m=mod: load(m), results)

    def rms():
        x = torch.randn(64, 1024, device=dev, dtype=torch.bfloat16)
        w = torch.randn(1024, device=dev, dtype=torch.bfloat16)
        out = torch.empty_like(x)
        torch.ops._C.rms_norm(out, x, w, 1e-6)
        ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)) * w.float()
        return (out.float() - ref).abs().max().item() / ref.abs().max().item()

    def silu_mul():
        x = torch.randn(64, 2 * 512, device=dev, dtype=torch.bfloat16)
        out = torch.empty(64, 512, device=dev, dtype=torch.bfloat16)
        torch.ops._C.silu_and_mul(out, x)
        ref = torch.nn.functional.silu(x[:, :512].float()) * x[:, 512:].float()
        return (out.float() - ref).abs().max().item() / ref.abs().max().item()

    def topk_softmax():
        from vllm import _custom_ops as ops

        g = torch.randn(64, 16, device=dev, dtype=torch.float32)
        w = torch.empty(64, 4, device=dev, dtype=torch.float32)
        ids = torch.empty(64, 4, device=dev, dtype=torch.int32)
        tei = torch.empty(64, 4, device=dev, dtype=torch.int32)
        ops.topk_softmax(w, ids, tei, g, False)
        rw, rids = torch.topk(torch.softmax(g, -1), 4)
        if not torch.equal(ids.long().sort(-1).values, rids.sort(-1).values):
            return 1.0
        return (w.sort(-1).values - rw.sort(-1).values).abs().max().item()

    def fa3():
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        s, h, d = 128, 8, 128
        q = torch.randn(s, h, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(s, h, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(s, h, d, device=dev, dtype=torch.bfloat16)
        cu = torch.tensor([0, s], device=dev, dtype=torch.int32)
        out = flash_attn_varlen_func(q, k, v, s, cu, s, cu_seqlens_k=cu, causal=True, fa_version=3)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True
        )[0].transpose(0, 1)
        return (out.float() - ref.float()).abs().max().item()

    check("_C.rms_norm", rms, results)
    check("_C.silu_and_mul", silu_mul, results)
    check("_moe_C.topk_softmax", topk_softmax, results)
    check("fa3.flash_attn_varlen_func", fa3, results)
    torch.cuda.synchronize()
    ok = all(r["ok"] for r in results.values())
    errors = sum("error" in r for r in results.values())  # exceptions (load/launch), not tolerance misses
    print("KERNELS_JSON " + json.dumps({"errors": errors, "ok": ok, "results": results}), flush=True)
    if "--strict" in sys.argv and not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
