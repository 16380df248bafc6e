"""SwiGLU's gate: silu(gate) * up over a fused [.., 2 * intermediate] projection."""

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
