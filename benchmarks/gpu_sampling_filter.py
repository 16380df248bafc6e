"""Top-k / top-p / min-p on the GPU: the sort-free Triton kernel (ops/triton_top_k_top_p.py) against
the sorted torch path (ops/sampler.py with torch kernels), both on the same logits, and the whole
sampling step (ops/sampler.sample: filter, softmax, draw) with torch kernels and with the engine's
CUDA choice (the kernel from TRITON_FILTER_MIN_ROWS rows, the sort below: this sets that bound).

Shapes: 1, 32 and 256 rows of Llama 3's 128,256-token vocabulary; settings: top-p 0.9 alone (what a
Llama 3 Instruct request gets from its generation_config when it sets none), top-k 50 with top-p 0.9,
and min-p 0.05 alone. The floor is one read and one write of the logits at the measured copy rate.

    PYTHONPATH=/tmp/site:$PWD/src python3 benchmarks/gpu_sampling_filter.py

Writes $OUT/gpu_sampling_filter.json (benchmarks/result_file.py).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_engine import copy_bandwidth_gbps  # noqa: E402
from result_file import gpu_names, write_result  # noqa: E402

from goodserve.ops.kernel_choice import TORCH_KERNELS, KernelChoice  # noqa: E402
from goodserve.ops.sampler import TRITON_FILTER_MIN_ROWS, SamplingBatch, sample, top_k_top_p_min_p  # noqa: E402
from goodserve.ops.triton_top_k_top_p import triton_top_k_top_p_min_p  # noqa: E402

SETTINGS = {"top_p_0.9": (None, 0.9, 0.0), "top_k_50_top_p_0.9": (50, 0.9, 0.0), "min_p_0.05": (None, 1.0, 0.05)}


def batch_for(rows: int, vocab: int, setting: tuple, device: str) -> SamplingBatch:
    top_k, top_p, min_p = setting
    return SamplingBatch(temperature=torch.full((rows,), 0.6, device=device),
                         top_k=torch.full((rows,), top_k or vocab, device=device),
                         top_p=torch.full((rows,), top_p, device=device),
                         min_p=torch.full((rows,), min_p, device=device),
                         generators=[None] * rows)


def time_us(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def measure(rows: int, vocab: int, setting: tuple, bandwidth_gbps: float) -> dict:
    logits = torch.randn(rows, vocab, device="cuda") * 5  # temperature 0.6 of logits a few units wide
    batch = batch_for(rows, vocab, setting, "cuda")
    triton_kernels = KernelChoice(triton=True)
    kept_sorted = torch.isfinite(top_k_top_p_min_p(logits, batch, TORCH_KERNELS)).sum(dim=-1).float().mean()
    return {
        "sorted_us": time_us(lambda: top_k_top_p_min_p(logits, batch, TORCH_KERNELS)),
        "triton_us": time_us(lambda: triton_top_k_top_p_min_p(logits, batch.top_k, batch.top_p, batch.min_p)),
        "sample_sorted_us": time_us(lambda: sample(logits, batch, TORCH_KERNELS)),
        "sample_engine_us": time_us(lambda: sample(logits, batch, triton_kernels)),
        "floor_us": 2 * logits.numel() * 4 / (bandwidth_gbps * 1e9) * 1e6,
        "mean_kept_tokens": kept_sorted.item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,32,256")
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args()
    bandwidth = copy_bandwidth_gbps()
    results = {"gpus": gpu_names(), "vocab": args.vocab, "copy_bandwidth_gbps": bandwidth,
               "triton_filter_min_rows": TRITON_FILTER_MIN_ROWS, "cases": {}}
    for name, setting in SETTINGS.items():
        for rows in map(int, args.rows.split(",")):
            case = measure(rows, args.vocab, setting, bandwidth)
            results["cases"][f"{name}/rows_{rows}"] = case
            print(f"{name:>20} rows {rows:>3}: sorted {case['sorted_us']:8.1f} us, triton {case['triton_us']:7.1f} us "
                  f"(floor {case['floor_us']:6.1f}); whole sample {case['sample_sorted_us']:8.1f} -> "
                  f"{case['sample_engine_us']:7.1f} us", flush=True)
    print(write_result("gpu_sampling_filter.json", results))


if __name__ == "__main__":
    main()
