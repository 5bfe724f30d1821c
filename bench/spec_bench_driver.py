"""Times speculators' VllmHiddenStatesGenerator.generate (the user's script, unchanged by hscapture).
usage: spec_bench_driver.py MODEL PROMPTS.json TP BATCH LAYERS  -> prints one JSON line."""

import json
import resource
import sys
import time

if __name__ == "__main__":
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    model, prompts_file, tp, batch, layers = sys.argv[1:6]
    prompts = json.load(open(prompts_file))
    gen = VllmHiddenStatesGenerator(
        model,
        layer_ids=[int(x) for x in layers.split(",")],
        max_model_len=max(map(len, prompts)) + 8,
        tensor_parallel_size=int(tp),
    )
    b = int(batch)
    gen.generate(prompts[:b])  # warm-up batch, not timed
    t0 = time.perf_counter()
    tokens = 0
    for i in range(b, len(prompts), b):
        for r in gen.generate(prompts[i : i + b]):
            tokens += len(r["input_ids"])
    seconds = time.perf_counter() - t0
    gen.executor.shutdown()  # reap the worker processes so that their peak RSS is counted
    peak_children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    peak_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        json.dumps(
            {"tokens": tokens, "seconds": seconds, "peak_worker_rss": peak_children, "peak_driver_rss": peak_self}
        ),
        flush=True,
    )
