"""Sliding-window attention at long context on the GPU: the Gemma-3-12B-shaped dummy model (40 local
layers with a 1024-token window, every sixth layer global) against the same shape with every layer
global, bf16, batch 1, a 32k-token prompt, then greedy decode.

Per model: the KV bytes one sequence of that context needs (ModelSpec.kv_bytes_per_sequence: a local
layer keeps its last 1024 tokens), the KV a decode step reads, the weight bytes, and batch-1 decode
tok/s (best of --runs, from the request's token times) beside the bandwidth limit those bytes set.

Note: the engine's KV pool gives every layer the same blocks, and frees blocks outside the window only
when every layer is local; for this hybrid the memory a sequence holds is still all-global's (the
saving shows in the bytes a decode step reads, and in `calc kv`). The dummy runs on the Llama decoder:
the same weight and KV sizes as Gemma 3, so the same bytes a step.

Prediction (written on the CPU): weights 23.6 GB bf16 (embedding included; tied lm_head read once more
in the step: ~25.6 GB read); KV read a step 12.9 GB all-global, 2.5 GB windowed; at ~2.7 TB/s effective
on an H100: ~70 tok/s all-global, ~95 tok/s windowed.

    python benchmarks/gpu_sliding_window.py [--context 32768] [--new-tokens 128] [--runs 3]
    --smoke: CPU, tiny preset with a window, a few tokens: catches Python errors only.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_file import gpu_names, write_result  # noqa: E402

from goodserve.diagnose.calc import weight_bytes  # noqa: E402
from goodserve.llm import LLM  # noqa: E402
from goodserve.sampling_params import SamplingParams  # noqa: E402

BANDWIDTH_GBPS = 3000.0  # H100 SXM copy bandwidth measured here (DESIGN.md: 3.01 TB/s)


def measure(model: str, context: int, new_tokens: int, runs: int, device: str, dtype: str) -> dict:
    llm = LLM(model, device=device, dtype=dtype, max_num_seqs=1, max_model_len=context + new_tokens + 16,
              enable_prefix_caching=False)
    spec = llm.spec
    prompt = {"prompt_token_ids": np.random.default_rng(0).integers(3, min(20000, spec.vocab_size), context).tolist()}
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up, graphs
    results = []
    for _ in range(runs):
        start = time.perf_counter()
        out = llm.generate(prompt, params)[0]
        times = out.metrics.token_times
        results.append({"e2e_s": time.perf_counter() - start, "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]),
                        "ttft_s": out.metrics.first_token_time - out.metrics.arrival_time})
    best = max(results, key=lambda r: r["decode_tok_s"])
    kv_bytes = spec.kv_bytes_per_sequence(context + new_tokens // 2, 2)  # mean context over the decode
    weights = weight_bytes(spec, "bf16")
    return {"model": model, "context": context, "new_tokens": new_tokens, "runs": results,
            "decode_tok_s": best["decode_tok_s"],
            "kv_bytes_per_sequence": spec.kv_bytes_per_sequence(context, 2),
            "kv_bytes_all_global": spec.kv_bytes_per_token(2) * context,
            "kv_read_bytes_per_step": kv_bytes, "weight_bytes": weights,
            "bandwidth_limit_tok_s": BANDWIDTH_GBPS * 1e9 / (weights + kv_bytes),
            "num_kv_blocks": llm.engine.config.num_kv_blocks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        import dataclasses

        from goodserve.model import presets

        tiny = presets.PRESETS["tiny"]
        presets.PRESETS["tiny-window"] = dataclasses.replace(tiny, name="tiny-window", layer_windows=(32, None))
        models, device, dtype, args.context, args.new_tokens, args.runs = \
            ["dummy:tiny-window", "dummy:tiny"], "cpu", "float32", 200, 4, 1
    else:
        models, device, dtype = ["dummy:gemma-3-12b", "dummy:gemma-3-12b-global"], "cuda", "bfloat16"
    result = {"gpus": gpu_names(), "models": {}}
    for model in models:
        result["models"][model] = measure(model, args.context, args.new_tokens, args.runs, device, dtype)
        print(model, {k: v for k, v in result["models"][model].items() if k != "runs"}, flush=True)
    print(write_result("gpu_sliding_window_smoke.json" if args.smoke else "gpu_sliding_window.json", result))


if __name__ == "__main__":
    main()
