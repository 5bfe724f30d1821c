"""The independent reference: HF transformers' own forward, read with hooks on its decoder layers.

HF decoder layers return the full residual stream (no fused residual), so ``after`` id ``i`` is
layer ``i``'s output and ``before`` id ``i`` is layer ``i``'s input. Runs in-process, or as
``python -m hscapture.testing.reference`` in a subprocess whose ``sys.path`` starts with
``HSCAPTURE_REFERENCE_PATH`` (a transformers 5.x install: transformers 4.57's DeepSeek differs from
vLLM's by ~2e-2, 5.x agrees).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from .. import _native


def compute(
    model_path: str, prompts: list[list[int]], layer_ids: list[int], convention: str, dtype: str = "float32"
) -> list:
    """Per prompt, a float32 tensor [L, n_layers, H] in ascending id order."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..capture.hooks import find_decoder_layers

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=getattr(torch, dtype))
    model.eval()
    n = model.config.num_hidden_layers
    points = _native.capture_points(layer_ids, convention, n)
    inner = getattr(model, "model", None)
    # HF's own place for the layers; other layouts (GPT-2's transformer.h, OPT's model.decoder.layers) found as the
    # plugin finds vLLM's
    layers = (
        inner.layers
        if isinstance(getattr(inner, "layers", None), torch.nn.ModuleList)
        else find_decoder_layers(model, n)[1]
    )
    grabbed: dict[int, torch.Tensor] = {}
    handles = []
    for slot, (kind, k) in enumerate(points):
        if kind == "embeddings":

            def pre(_m, args, kwargs, slot=slot):
                h = kwargs.get("hidden_states", args[0] if args else None)
                grabbed[slot] = h.detach().float()

            handles.append(layers[0].register_forward_pre_hook(pre, with_kwargs=True))
        else:

            def post(_m, _a, out, slot=slot):
                h = out[0] if isinstance(out, (tuple, list)) else out
                grabbed[slot] = h.detach().float()

            handles.append(layers[k].register_forward_hook(post))
    out = []
    with torch.no_grad():
        for ids in prompts:
            grabbed.clear()
            model(input_ids=torch.tensor([ids]))
            out.append(torch.stack([grabbed[s][0] for s in range(len(points))], dim=1))
    for h in handles:
        h.remove()
    return out


def reference_path() -> str | None:
    """``HSCAPTURE_REFERENCE_PATH``, else ``<venv>/ref-transformers`` if the set-up script made it."""
    from .. import envs

    p = envs.get("HSCAPTURE_REFERENCE_PATH")
    if p:
        return p
    default = Path(sys.prefix) / "ref-transformers"
    return str(default) if default.is_dir() else None


def compute_subprocess(
    model_path: str,
    prompts: list[list[int]],
    layer_ids: list[int],
    convention: str,
    workdir: str | Path,
    python: str | None = None,
) -> list:
    """``compute`` in a fresh interpreter with ``HSCAPTURE_REFERENCE_PATH`` first on ``sys.path``."""
    from safetensors.torch import load_file

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    req = workdir / "reference_request.json"
    res = workdir / "reference.safetensors"
    req.write_text(json.dumps({"model": model_path, "prompts": prompts, "layers": layer_ids, "convention": convention}))
    env = dict(os.environ)
    extra = reference_path()
    if extra:
        env["PYTHONPATH"] = extra + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    subprocess.run(
        [python or sys.executable, "-m", "hscapture.testing.reference", str(req), str(res)], check=True, env=env
    )
    t = load_file(str(res))
    return [t[f"p{i}"] for i in range(len(prompts))]


def reference_version(workdir: str | Path) -> str:
    """The transformers version the last ``compute_subprocess`` in ``workdir`` used."""
    from safetensors import safe_open

    with safe_open(str(Path(workdir) / "reference.safetensors"), "pt") as f:
        return (f.metadata() or {}).get("transformers", "?")


def _main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("request")
    ap.add_argument("result")
    a = ap.parse_args()
    import transformers
    from safetensors.torch import save_file

    r = json.loads(Path(a.request).read_text())
    outs = compute(r["model"], r["prompts"], r["layers"], r["convention"])
    save_file(
        {f"p{i}": t.contiguous() for i, t in enumerate(outs)},
        a.result,
        metadata={"transformers": transformers.__version__},
    )


if __name__ == "__main__":
    _main()
