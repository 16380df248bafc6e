"""Context parallelism: time to first token of one long prompt at --context-parallel-size 1, 2 and 4
(those the GPUs here allow), dummy llama-3.1-8b bf16, from short prompts to a 128k-token one.

Each size runs in this process's engine (CP>1: one worker process per GPU, NCCL; CP=1, last: the
worker in this process), one size after another, each over every prompt length (--lengths), so the same
call gives the speedups (targets at 128k: CP=2 >= 1.7x, CP=4 >= 3x) and the prompt length from which
each size pays: the shortest measured length from which its TTFT stays below CP=1's.

A prompt is prefilled in chunks of --max-num-batched-tokens (the same at every size); each chunk is
cut into 2N zigzag pieces over the N ranks, which gather each layer's K/V. Every rank keeps the whole
KV cache, so memory a rank holds does not shrink with N: the JSON records, per size, the memory
each GPU uses (nvidia-smi, the KV pool included, sized by --gpu-memory-utilization), the KV bytes
the longest prompt fills on each rank, and the weights a rank holds. max_model_len is raised to the
longest prompt plus the tokens generated. Greedy tokens of every size are recorded beside CP=1's
(bf16: an equal first token is expected, not guaranteed, where two logits are near-tied).

  python benchmarks/gpu_context_parallel.py [--sizes 4,2,1] [--lengths 1024,...,131000]   (2- or 4-GPU host)
  torchrun --nproc-per-node 4 benchmarks/gpu_context_parallel.py   (CP=4 over torchrun's ranks, then CP=1)
  python benchmarks/gpu_context_parallel.py --smoke   (CPU, gloo, dummy:tiny float32, CP=1, 2, 3, short prompts)

Under torchrun the ranks other than 0 serve as the engine's workers (`goodserve worker` does the same)
and rank 0 runs the engine: CP = torchrun's world, then CP=1 on its own GPU once the workers have left.

Writes $OUT/gpu_context_parallel.json (or gpu_context_parallel_smoke.json) and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import subprocess
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before any NCCL communicator exists (workers inherit it)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from goodserve import LLM, SamplingParams  # noqa: E402
from goodserve.model.llama import build_empty_model  # noqa: E402
from goodserve.model.presets import get_preset  # noqa: E402
from result_file import gpu_names, write_result  # noqa: E402

GPU_LENGTHS = "1024,2048,4096,8192,16384,32768,65536,131000"
SMOKE_LENGTHS = "8,33,64,127"
NEW_TOKENS = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=None, help="comma-separated context-parallel sizes, 1 among them "
                        "(default: 4, 2, 1, those the GPUs here allow; under torchrun its world size, then 1)")
    parser.add_argument("--lengths", default=None, help=f"comma-separated prompt lengths (default: {GPU_LENGTHS})")
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384,
                        help="the prefill chunk, the same at every size (default: 16384)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per length below 32k tokens, the best "
                        "kept (longer ones run once)")
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, dummy:tiny float32, CP=1, 2, 3, short prompts")
    args = parser.parse_args(argv)
    args.torchrun_world = int(os.environ.get("WORLD_SIZE", "1")) if "TORCHELASTIC_RUN_ID" in os.environ else 1
    args.device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.model, args.dtype = "dummy:tiny", "float32"
        args.sizes, args.lengths = args.sizes or "1,2,3", args.lengths or SMOKE_LENGTHS
        args.max_num_batched_tokens = min(args.max_num_batched_tokens, 64)
    if args.sizes is None:
        # CP=1 last: until then this process holds no CUDA context on the ranks' first GPU
        args.sizes = f"{args.torchrun_world},1" if args.torchrun_world > 1 else \
            ",".join(str(s) for s in (4, 2, 1) if s <= torch.cuda.device_count())
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.lengths = sorted(int(n) for n in (args.lengths or GPU_LENGTHS).split(","))
    if 1 not in args.sizes:
        parser.error("--sizes must include 1: the baseline the others are compared with")
    if args.torchrun_world > 1 and set(args.sizes) != {1, args.torchrun_world}:
        parser.error(f"under torchrun the sizes are its world ({args.torchrun_world}) and 1")
    return args


def prompt(length: int, vocab_size: int, seed: int) -> dict:
    """Random ids (no two lengths share a prefix, so the prefix cache reuses nothing)."""
    return {"prompt_token_ids": np.random.default_rng(seed).integers(100, vocab_size - 100, length).tolist()}


def ttft_s(llm: LLM, length: int, repeats: int) -> tuple[float, list[int]]:
    """The best of `repeats` runs' time to first token, and the greedy tokens."""
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    best, tokens = float("inf"), []
    for run in range(repeats):
        out = llm.generate(prompt(length, llm.spec.vocab_size, seed=1000 * length + run), greedy)[0]
        best = min(best, out.metrics.first_token_time - out.metrics.arrival_time)
        tokens = tokens or out.outputs[0].token_ids
    return best, tokens


def gpu_memory_used_mib() -> list[int]:
    """MiB used on each GPU, every process's (the ranks are processes of their own)."""
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(line) for line in listed.split()]


def measure(args: argparse.Namespace, size: int) -> dict:
    with engine(args, size) as llm:
        # Warm-up: the kernels compile on a short prompt, then on two whole chunks (a longer prompt's
        # steps are chunks of the same shape over a longer context), and the allocator grows.
        ttft_s(llm, min(args.lengths), 1)
        ttft_s(llm, min(max(args.lengths), 2 * args.max_num_batched_tokens), 1)
        rows = []
        for length in args.lengths:
            seconds, tokens = ttft_s(llm, length, args.repeats if length < 32768 else 1)
            rows.append({"prompt_len": length, "ttft_s": seconds, "prefill_tok_s": length / seconds, "tokens": tokens})
            print(f"CP={size} {length:>7} tokens: TTFT {seconds:.3f} s", flush=True)
        stats = llm.engine.stats()
        spec = llm.spec
        return {"context_parallel_size": size, "lengths": rows,
                "split_steps": stats.num_context_parallel_steps,
                "gpu_memory_used_mib": gpu_memory_used_mib() if args.device == "cuda" else [],
                "kv_blocks_per_rank": stats.num_kv_blocks,
                "longest_prompt_kv_bytes_per_rank": spec.kv_bytes_per_token(getattr(torch, args.dtype).itemsize)
                * (max(args.lengths) + NEW_TOKENS),
                "weight_bytes_per_rank": weight_bytes(args)}


def weight_bytes(args: argparse.Namespace) -> int:
    """Every rank holds the whole model under context parallelism."""
    model = build_empty_model(get_preset(args.model.removeprefix("dummy:")), getattr(torch, args.dtype), "meta")
    return sum(p.numel() * p.element_size() for p in model.parameters())


@contextlib.contextmanager
def engine(args: argparse.Namespace, size: int):
    """An LLM at one size, its worker processes shut and its GPU memory given back after. Under
    torchrun the CP>1 engine starts rank 0 only; the others are torchrun's own processes."""
    options = {"max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": max(args.lengths) + NEW_TOKENS,
               "enable_prefix_caching": False}
    if args.device == "cuda":
        options["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        options["num_kv_blocks"] = 4 * (max(args.lengths) + NEW_TOKENS) // 16 + 8
    restore = os.environ.get("LOCAL_WORLD_SIZE")
    if args.torchrun_world > 1:
        os.environ["LOCAL_WORLD_SIZE"] = "1" if size > 1 else str(args.torchrun_world)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, quantization="none", context_parallel_size=size,
              **options)
    try:
        yield llm
    finally:
        llm.engine.executor.shutdown()
        vars(llm).clear()
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        if restore is not None:
            os.environ["LOCAL_WORLD_SIZE"] = restore


def pays_from(base: list[dict], rows: list[dict]) -> int | None:
    """The shortest measured length from which this size's TTFT stays below the baseline's."""
    found = None
    for mine, one in zip(reversed(rows), reversed(base)):
        if mine["ttft_s"] >= one["ttft_s"]:
            break
        found = mine["prompt_len"]
    return found


def report(args: argparse.Namespace, sizes: list[dict]) -> dict:
    base = next(s for s in sizes if s["context_parallel_size"] == 1)
    for size in sizes:
        for mine, one in zip(size["lengths"], base["lengths"]):
            mine["speedup_over_cp1"] = one["ttft_s"] / mine["ttft_s"]
            mine["first_token_as_cp1"] = mine["tokens"][:1] == one["tokens"][:1]
        size["pays_from_prompt_len"] = pays_from(base["lengths"], size["lengths"])
    return {"model": args.model, "dtype": args.dtype, "device": args.device,
            "gpus": gpu_names() if args.device == "cuda" else [], "max_num_batched_tokens": args.max_num_batched_tokens,
            "launcher": "torchrun" if args.torchrun_world > 1 else "goodserve", "sizes": sizes}


def print_table(result: dict) -> None:
    sizes = result["sizes"]
    print(f"{'prompt':>8} " + " ".join(f"{'CP=' + str(s['context_parallel_size']) + ' s':>10} {'x':>5}" for s in sizes))
    for i, length in enumerate(r["prompt_len"] for r in sizes[0]["lengths"]):
        rows = [s["lengths"][i] for s in sizes]
        print(f"{length:>8} " + " ".join(f"{r['ttft_s']:>10.3f} {r['speedup_over_cp1']:>5.2f}" for r in rows))
    for s in sizes:
        print(f"CP={s['context_parallel_size']}: pays from {s['pays_from_prompt_len']} tokens; "
              f"{s['split_steps']} split steps; GPU memory used (MiB) {s['gpu_memory_used_mib']}; the longest prompt's KV "
              f"{s['longest_prompt_kv_bytes_per_rank'] / 2**30:.2f} GiB on each rank")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.torchrun_world > 1 and int(os.environ["RANK"]) != 0:
        from goodserve.engine.worker.executor import run_follower

        run_follower()  # a worker of rank 0's CP engine, until it shuts down
        return
    started = time.perf_counter()
    result = report(args, [measure(args, size) for size in args.sizes])
    result["wall_s"] = time.perf_counter() - started
    path = write_result("gpu_context_parallel_smoke.json" if args.smoke else "gpu_context_parallel.json", result)
    print_table(result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
