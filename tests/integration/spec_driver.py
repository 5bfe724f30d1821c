"""A speculators user's script: VllmHiddenStatesGenerator as its docs show it, untouched by hscapture.
Run by the tests through `hscapture run-speculators [--own-extension] spec_driver.py ...`.

usage: spec_driver.py MODEL PROMPTS.json OUT.safetensors TP MAX_BATCHED LAYERS
"""

import inspect
import json
import sys

if __name__ == "__main__":
    from safetensors.torch import save_file
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    model, prompts_file, out, tp, max_batched, layers = sys.argv[1:7]
    prompts = json.load(open(prompts_file))
    kwargs = dict(layer_ids=[int(x) for x in layers.split(",")], max_model_len=256, tensor_parallel_size=int(tp))
    if "max_num_batched_tokens" in inspect.signature(VllmHiddenStatesGenerator.__init__).parameters:
        kwargs["max_num_batched_tokens"] = int(max_batched)  # speculators 0.4; 0.3 always uses >= 8192
    gen = VllmHiddenStatesGenerator(model, **kwargs)
    tensors = {}
    for batch, ps in enumerate([prompts[: len(prompts) // 2], prompts[len(prompts) // 2 :]]):
        for i, r in enumerate(gen.generate(ps)):
            tensors[f"b{batch}_s{i}_input_ids"] = r["input_ids"]
            for k, h in enumerate(r["hidden_states"]):
                tensors[f"b{batch}_s{i}_l{k}"] = h.contiguous()
    save_file(tensors, out)
    print(f"[driver] wrote {len(tensors)} tensors", flush=True)
    del gen
