"""Dense 16-bit linears whose decode-sized matmuls run on the Triton GEMV.

At a few rows a linear is a weight read. For the shapes and row counts (1, or 2..16) that have a
dense entry in ops/triton_gemv.TUNED_CONFIGS, the tuned GEMV is routed to instead of cuBLAS: alone
it reads about as fast (lm_head 337 vs 375 us, gate_up 78 vs 81 us at one row on Llama-3.1-8B,
benchmarks/results/gpu_gemv_h100.json), and inside a decode step it launches with programmatic
dependent launch (ops/pdl.py), so its start overlaps the previous kernel's end, which cuBLAS's
kernels do not. Every other shape and row count stays on cuBLAS. Today only one-row entries exist:
routing 2..16 rows of every Llama-3.1-8B linear to the GEMV's best tiles changed nothing measurable
in the ShareGPT-like run (43.03 vs 42.98 req/s, benchmarks/results/gpu_engine_routing_h100.json).
KernelOptions.cublas_linears keeps chosen shapes on cuBLAS (benchmarks/gpu_engine.py's `cublasqkv`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from goodserve.ops.kernel_choice import KernelChoice
from goodserve.ops.triton_gemv import GEMV_MAX_M, TUNED_CONFIGS, dense_gemv, rows_bucket

GEMV_DTYPES = (torch.bfloat16, torch.float16)


def gemv_wins(linear: nn.Linear, rows: int) -> bool:
    """Whether the GEMV is the measured choice for this linear's shape and dtype at `rows` rows."""
    weight = linear.weight
    return (weight.dtype in GEMV_DTYPES and rows <= GEMV_MAX_M
            and ("dense", rows_bucket(rows), *weight.shape) in TUNED_CONFIGS)


class GemvLinear(nn.Module):
    """nn.Linear on the same weight (a tied lm_head keeps sharing the embedding's); the row counts
    the GEMV wins go to it (where the model's kernels are Triton's), the others to F.linear."""

    def __init__(self, linear: nn.Linear, kernels: KernelChoice):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if not (self.kernels.triton and gemv_wins(self, rows.shape[0])):
            return F.linear(x, self.weight, self.bias)
        y = dense_gemv(rows, self.weight, self.kernels.pdl)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def route_decode_rows_to_gemv(model: nn.Module, kernels: KernelChoice) -> int:
    """Swap each CUDA nn.Linear that the GEMV wins at some row count (and kernels.options.cublas_linears
    does not keep on cuBLAS) for a GemvLinear; returns how many."""
    kept = set(kernels.options.cublas_linears)
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.is_cuda and tuple(child.weight.shape) not in kept
             and any(gemv_wins(child, rows) for rows in (1, GEMV_MAX_M))]
    for parent, name, linear in swaps:
        setattr(parent, name, GemvLinear(linear, kernels))
    return len(swaps)
