"""A mixture of experts' feed-forward (Mixtral, Qwen3-MoE): routing and the experts' SwiGLU MLPs.

Each token's router logits pick its top-k experts (softmax over all experts in float32, then the k
largest, renormalised to sum 1 where the model says so); its output is the routed experts' outputs
weighted by those probabilities. The experts of a layer are stacked: w13 [E * 2I, H] holds expert
e's gate then up rows at e * 2I, w2 [E * H, I] its down rows at e * H.

With quantized experts (model/moe.QuantizedExperts) each stack is an Int8Weight / Int4Weight of
quant/schemes.py, the experts' rows one after another.

`moe_torch` is the CPU path and the reference: tokens sorted by expert, one pair of matmuls per
expert that any token chose (a loop over experts, never over tokens); a quantized expert is dequantized
when its turn comes, so no float copy of the whole stack is made. On CUDA the Triton path
(quant/triton_moe.py) does the same in one launch per projection (a grouped GEMM; at decode a GEMV
per pair). Both live in quant/, above ops/, since an expert stack may be codes of quant/schemes.py.
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


Stack = torch.Tensor | schemes.Int8Weight | schemes.Int4Weight  # float, or codes (quant/schemes.py)


def stack_rows(stack: Stack) -> int:
    return getattr(stack, "qweight", stack).shape[0]


def expert_weight(stack: Stack, expert: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert `expert`'s [rows, K] weight out of a stack (its codes dequantized)."""
    own = slice(expert * rows, (expert + 1) * rows)
    if isinstance(stack, torch.Tensor):
        return stack[own]
    return schemes.dequantize(schemes.rows_of(stack, own), dtype)


def moe_torch(x: torch.Tensor, w13: Stack, w2: Stack, weights: torch.Tensor, ids: torch.Tensor,
              kernels: KernelChoice) -> torch.Tensor:
    """x [T, H], weights / ids [T, k] (route's) -> [T, H]: sum over k of weight * expert(x)."""
    hidden, top_k = x.shape[1], ids.shape[1]
    num_experts = stack_rows(w2) // hidden
    gate_up_rows = stack_rows(w13) // num_experts
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
        gate_up = x[tokens] @ expert_weight(w13, expert, gate_up_rows, x.dtype).T
        down = silu_and_mul(gate_up, kernels) @ expert_weight(w2, expert, hidden, x.dtype).T
        out.index_add_(0, tokens, down * flat_weights[pairs].unsqueeze(1))
    return out
