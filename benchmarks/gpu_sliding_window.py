"""Sliding-window attention at long context on the GPU: the Gemma-3-12B-shaped dummy model (40 local
layers with a 1024-token window, every sixth layer global) against the same shape with every layer
global, bf16, batch 1, a 32k-token prompt, then greedy decode.

Per model: the KV bytes one sequence of that context needs (ModelSpec.kv_bytes_per_sequence: a local
layer keeps its last 1024 tokens) and the bytes the engine's pool holds for it while it decodes (the
hybrid pool, engine/setup/kv_groups.py, keeps a local layer group's blocks within its window only); the
pool's room (its blocks, and how many sequences and tokens of that context it holds); the KV a decode
step reads, the weight bytes, and batch-1 decode tok/s (best of --runs, from the request's token
times) beside the bandwidth limit those bytes set. Each model runs in a process of its own, so the
second engine's pool is sized from a GPU the first one has left. The dummy runs on the Llama
decoder: the same weight and KV sizes as Gemma 3, so the same bytes a step.

Prediction (written on the CPU): weights 23.6 GB bf16 (embedding included; tied lm_head read once more
in the step: ~25.6 GB read); KV read a step 12.9 GB all-global, 2.5 GB windowed; at ~2.7 TB/s effective
on an H100: ~70 tok/s all-global, ~95 tok/s windowed. The pool holds a 32k-token sequence in 12.9 GB
all-global, ~2.5 GB hybrid (its global layer group's 2048 blocks of 16 tokens and each of its five local
groups' 65): about 5x the sequences, and tokens of room, in the same memory.

    python benchmarks/gpu_sliding_window.py [--context 32768] [--new-tokens 128] [--runs 3]
    --smoke: CPU, tiny preset with a window, a few tokens: catches Python errors only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_file import gpu_names, write_result  # noqa: E402

from goodserve.diagnose.calc import weight_bytes  # noqa: E402
from goodserve.engine.setup.config_resolution import torch_dtype  # noqa: E402
from goodserve.engine.frontend.input_processor import sequence_id  # noqa: E402
from goodserve.engine.setup.kv_cache import bytes_per_block, kv_storage_dtype  # noqa: E402
from goodserve.engine.setup.kv_groups import kv_groups  # noqa: E402
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
    pool = pool_room(llm, prompt, context)
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
            "bandwidth_limit_tok_s": BANDWIDTH_GBPS * 1e9 / (weights + kv_bytes), **pool}


def pool_room(llm: LLM, prompt: dict, context: int) -> dict:
    """The pool's blocks and bytes, and what one sequence at `context` tokens holds of them while it
    decodes (its used blocks after a decode step, alone in the engine): the sequences and tokens of
    that context the pool has room for."""
    engine, config = llm.engine, llm.engine.config
    groups = kv_groups(engine.spec, config)
    kv_dtype = kv_storage_dtype(config, torch_dtype(config))
    layers_per_block = len(groups.slots(range(engine.spec.num_layers)))
    block_bytes = bytes_per_block(engine.spec, config.block_size, kv_dtype, layers_per_block)
    engine.add_request("room", prompt["prompt_token_ids"], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    held = 0
    while engine.has_unfinished():
        engine.step()
        seq = engine.scheduler.seqs.get(sequence_id("room", 0))
        if seq is not None:  # the last time: its prompt computed, a token sampled, the next one to decode
            engine.kv.allocate(seq, 0)  # releases the blocks out of the window, as scheduling it does
            held = engine.kv.num_used_blocks
    sequences = config.num_kv_blocks / held
    return {"num_kv_blocks": config.num_kv_blocks, "kv_block_bytes": block_bytes, "kv_layer_groups": groups.num_groups,
            "kv_pool_bytes": config.num_kv_blocks * block_bytes, "kv_bytes_held_per_sequence": held * block_bytes,
            "sequences_of_context_in_pool": sequences, "kv_room_tokens": int(sequences * context)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # measure this model alone, print its JSON
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
    if args.one:
        print(json.dumps(measure(args.one, args.context, args.new_tokens, args.runs, device, dtype)))
        return
    result = {"gpus": gpu_names(), "models": {}}
    for model in models:
        result["models"][model] = measure_in_own_process(model, args)
        print(model, {k: v for k, v in result["models"][model].items() if k != "runs"}, flush=True)
    print(write_result("gpu_sliding_window_smoke.json" if args.smoke else "gpu_sliding_window.json", result))


def measure_in_own_process(model: str, args: argparse.Namespace) -> dict:
    """measure() in a child process: its engine's memory is all given back when it exits."""
    command = [sys.executable, __file__, "--one", model, "--context", str(args.context), "--new-tokens",
               str(args.new_tokens), "--runs", str(args.runs), *(["--smoke"] if args.smoke else [])]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"{model} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
