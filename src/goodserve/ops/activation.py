"""SwiGLU's gate: silu(gate) * up over a fused [.., 2 * intermediate] projection."""

import torch
import torch.nn.functional as F

from goodserve.native import layer_ops
from goodserve.ops.kernel_choice import KernelChoice


def silu_and_mul(gate_up: torch.Tensor, kernels: KernelChoice) -> torch.Tensor:
    if kernels.triton:
        from goodserve.ops.triton_ops import triton_silu_and_mul

        return triton_silu_and_mul(gate_up, kernels.pdl)
    if layer_ops.usable(gate_up):  # CPU float32: one native call (native/layer_ops.cpp)
        return layer_ops.silu_and_mul(gate_up)
    return silu_and_mul_torch(gate_up)


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
