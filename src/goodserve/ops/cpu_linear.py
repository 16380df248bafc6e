"""Dense float32 linears on the CPU through oneDNN's packed-weight kernel.

A decode step multiplies one row by every weight matrix, so CPU decode speed is how fast a GEMV
streams the weights. torch's default float32 F.linear does it at about 11 GB/s on this project's
AMD EPYC; oneDNN, given the weight once in its own blocked layout (what torch.compile's CPU
"freezing" does), streams it about twice as fast and is faster for prefill-sized batches too
(benchmarks/cpu_engine.py measures the end-to-end effect). The packed copy replaces the
nn.Linear's weight, so memory stays the same, except for a tied lm_head, whose float table the
embedding lookup still needs.
"""

from __future__ import annotations

import torch
from torch import nn

# oneDNN picks its blocking for this many rows; 64 measured best for both one-row decode and
# prefill batches (a hint of 1 slows prefill down, and larger hints gained nothing at one row).
PACK_ROWS_HINT = 64


def cpu_packing_available(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedCpuLinear(nn.Module):
    """nn.Linear's forward on a weight pre-packed for oneDNN; same results to float32 rounding."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_ROWS_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears_for_cpu(model: nn.Module) -> int:
    """Swap every float32 CPU nn.Linear in `model` for a PackedCpuLinear; returns how many.

    Call it last, once the weights are final: a packed weight is opaque, so quantization, AWQ
    and checkpoint saving must already have read the float weights.
    """
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.device.type == "cpu"
             and cpu_packing_available(child.weight.dtype)]
    for parent, name, linear in swaps:
        setattr(parent, name, PackedCpuLinear(linear))
    return len(swaps)
