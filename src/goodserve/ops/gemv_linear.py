"""Dense 16-bit linears whose one-row matmul (batch-1 decode) runs on the Triton GEMV.

At one row a linear is a weight read. For the shapes in ops/triton_gemv.TUNED_CONFIGS' dense
entries, the tuned GEMV read faster than cuBLAS on an H100 (lm_head 337 vs 375 us, gate_up 78 vs
81 us on Llama-3.1-8B: about 0.17 ms of a 6.4 ms token; benchmarks/results/gpu_gemv_h100.json).
Every other shape, and every call with more rows, stays on cuBLAS, which is as fast or faster there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from goodserve.ops.attention import use_triton
from goodserve.ops.triton_gemv import TUNED_CONFIGS, dense_gemv

GEMV_DTYPES = (torch.bfloat16, torch.float16)


def gemv_wins(linear: nn.Linear) -> bool:
    """Whether the one-row GEMV was measured faster than cuBLAS for this linear's shape and dtype."""
    weight = linear.weight
    return weight.dtype in GEMV_DTYPES and ("dense", 1, *weight.shape) in TUNED_CONFIGS


class GemvLinear(nn.Module):
    """nn.Linear on the same weight (a tied lm_head keeps sharing the embedding's); one row goes to
    the Triton GEMV, more rows to F.linear."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] != 1 or not use_triton(rows):
            return F.linear(x, self.weight, self.bias)
        y = dense_gemv(rows, self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def route_single_rows_to_gemv(model: nn.Module) -> int:
    """Swap each CUDA nn.Linear whose shape the GEMV wins for a GemvLinear; returns how many."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.is_cuda and gemv_wins(child)]
    for parent, name, linear in swaps:
        setattr(parent, name, GemvLinear(linear))
    return len(swaps)
