"""A mixture of experts' feed-forward (Mixtral, Qwen3-MoE): routing and the experts' SwiGLU MLPs.

Each token's router logits pick its top-k experts (softmax over all experts in float32, then the k
largest, renormalised to sum 1 where the model says so); its output is the routed experts' outputs
weighted by those probabilities. The experts of a layer are stacked: w13 [E * 2I, H] holds expert
e's gate then up rows at e * 2I, w2 [E * H, I] its down rows at e * H.

With int8 experts (model/moe.Int8Experts) the stacks hold int8 codes and each op takes their
per-row scales: the weight is codes * scale (quant/schemes.py).

`moe_torch` is the CPU path and the reference: tokens sorted by expert, one pair of matmuls per
expert that any token chose (a loop over experts, never over tokens); an int8 expert is dequantized
when its turn comes, so no float copy of the whole stack is made. On CUDA the Triton path
(ops/triton_moe.py) does the same in one grouped GEMM launch per projection.
"""

from __future__ import annotations

import torch

from goodserve.ops.activation import silu_and_mul
from goodserve.ops.kernel_choice import KernelChoice
from goodserve.quant import schemes


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, k] float32, expert ids [T, k] int64)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_weight(stack: torch.Tensor, scales: torch.Tensor | None, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """One expert's [N, K] weight from a stack viewed [E, N, K] (its int8 codes dequantized)."""
    if scales is None:
        return stack[expert]
    return schemes.dequantize_int8(schemes.Int8Weight(stack[expert], scales[expert]), dtype)


def moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              kernels: KernelChoice, w13_scales: torch.Tensor | None = None,
              w2_scales: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], weights / ids [T, k] (route's) -> [T, H]: sum over k of weight * expert(x).
    w13_scales [E * 2I], w2_scales [E * H]: int8 stacks' scales (None: float stacks)."""
    num_experts, top_k = w2.shape[0] // x.shape[1], ids.shape[1]
    w13, w2 = w13.view(num_experts, -1, x.shape[1]), w2.view(num_experts, x.shape[1], -1)
    if w13_scales is not None:
        w13_scales, w2_scales = w13_scales.view(num_experts, -1), w2_scales.view(num_experts, -1)
    flat_ids = ids.flatten()
    order = flat_ids.argsort(stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    flat_weights = weights.flatten().to(x.dtype)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        gate_up = x[tokens] @ expert_weight(w13, w13_scales, expert, x.dtype).T
        hidden = silu_and_mul(gate_up, kernels) @ expert_weight(w2, w2_scales, expert, x.dtype).T
        out.index_add_(0, tokens, hidden * flat_weights[pairs].unsqueeze(1))
    return out
