"""Decode-step matmuls at 64-512 rows (the big decode batches of the ShareGPT-like run): cuBLAS's own
choice for F.linear against other ways to ask cuBLAS for the same product.

Paths, for each Llama-3.1-8B linear and M in --rows:
  linear      F.linear(x, W): what the engine runs
  swapped     (W @ x^T)^T: the same GEMM with the operands' roles exchanged, so cuBLAS's heuristic
              sees N x M instead of M x N and may pick other tiles; made contiguous
  halves      the rows in two calls of M/2 (each reads the whole weight)
  cublaslt    F.linear with torch.backends.cuda.preferred_blas_library("cublaslt")
Each is timed in a CUDA graph that cycles through copies of its weight totalling >= 256 MB, so
weights stream from HBM. Reported: us per call, TFLOP/s, and the max abs difference from `linear`.

    PYTHONPATH=src python3 benchmarks/gpu_gemm.py [--rows 64,128,256,448]   # writes $OUT/gpu_gemm.json
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from result_file import write_result

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
          "down_proj": (4096, 14336), "lm_head": (128256, 4096)}
STREAM_BYTES = 256 << 20


def linear(x, w):
    return F.linear(x, w)


def swapped(x, w):
    return torch.mm(w, x.t()).t().contiguous()


def halves(x, w):
    out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
    half = x.shape[0] // 2
    torch.mm(x[:half], w.t(), out=out[:half])
    torch.mm(x[half:], w.t(), out=out[half:])
    return out


def cublaslt(x, w):
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return F.linear(x, w)
    finally:
        torch.backends.cuda.preferred_blas_library("default")


PATHS = {"linear": linear, "swapped": swapped, "halves": halves, "cublaslt": cublaslt}


def graph_us(fn, weights, x) -> float:
    """Microseconds per call, in a graph that calls fn once on each weight copy."""
    for w in weights:
        fn(x, w)  # choose algorithms and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    return do_bench(graph.replay, warmup=5, rep=50, return_mode="median") * 1e3 / len(weights)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="64,128,192,256,320,384,448,512")
    args = parser.parse_args()
    results = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for name, (n, k) in SHAPES.items():
        copies = max(1, -(-STREAM_BYTES // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = linear(x, weights[0])
            row = {"layer": name, "M": m, "N": n, "K": k}
            for path, fn in PATHS.items():
                us = graph_us(fn, weights, x)
                row[path] = {"us": round(us, 2), "tflops": round(2 * m * n * k / us / 1e6, 1),
                             "max_abs_diff": float((fn(x, weights[0]) - want).abs().max())}
            best = min(PATHS, key=lambda p: row[p]["us"])
            print(f"{name:13s} M={m:4d} " + " ".join(f"{p} {row[p]['us']:7.1f}" for p in PATHS) + f"  best {best}",
                  flush=True)
            results["rows"].append(row)
        del weights
        torch.cuda.empty_cache()
    write_result("gpu_gemm.json", results)


if __name__ == "__main__":
    main()
