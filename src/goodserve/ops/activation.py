"""The gated MLPs' activations over a fused [.., 2 * intermediate] projection: SwiGLU's silu(gate) * up,
GeGLU's gelu(gate) * up (tanh-approximate, as Gemma's gelu_pytorch_tanh)."""

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


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU, plain torch on every device (two elementwise kernels on CUDA)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
