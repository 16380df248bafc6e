"""The mixture-of-experts block that replaces the MLP in Mixtral and Qwen3-MoE layers.

Parameter names follow the checkpoints' where they can (`gate` is the router); the experts are
stacked into two parameters (ops/moe.py's layout) that the loaders fill expert by expert.
"""

from __future__ import annotations

import torch
from torch import nn

from goodserve.errors import InvalidRequestError
from goodserve.model.spec import ModelSpec
from goodserve.ops.kernel_choice import TORCH_KERNELS
from goodserve.ops.moe import moe_torch, route


def check_moe_combination(spec: ModelSpec, tensor_parallel_size: int) -> None:
    """Tensor parallelism would need each rank's share of every expert (or whole experts per rank,
    with the all-to-all that needs): not built, so refused rather than run unsplit."""
    if spec.is_moe and tensor_parallel_size > 1:
        raise InvalidRequestError(f"{spec.name} is a mixture of experts: --tensor-parallel-size > 1 is not "
                                  "supported for it")


class Experts(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
        self.w13 = nn.Parameter(torch.empty(e * 2 * i, h))
        self.w2 = nn.Parameter(torch.empty(e * h, i))


class SparseMoE(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.top_k, self.renormalize = spec.num_experts_per_tok, spec.norm_topk_prob
        self.gate = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        self.experts = Experts(spec)
        self.kernels = TORCH_KERNELS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels.triton:
            from goodserve.ops.triton_moe import triton_fused_moe, triton_route

            weights, ids = triton_route(self.gate(x), self.top_k, self.renormalize)
            return triton_fused_moe(x, self.experts.w13, self.experts.w2, weights, ids, self.kernels)
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        return moe_torch(x, self.experts.w13, self.experts.w2, weights, ids, self.kernels)
