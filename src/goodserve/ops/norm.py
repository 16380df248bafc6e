"""RMSNorm, optionally fused with the residual add that precedes it.

The *_torch functions are the references; rms_norm / add_rms_norm dispatch to the Triton kernels
(ops/triton_ops.py) where the caller's KernelChoice says so, and on the CPU in float32 to the native
kernel (native/layer_ops.cpp: one call instead of about eight torch ops).
"""

from __future__ import annotations

import dataclasses

import torch

from goodserve.native import layer_ops
from goodserve.ops.kernel_choice import KernelChoice


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernels: KernelChoice,
             weight_offset: float = 0.0) -> torch.Tensor:
    """weight_offset: Gemma's norms scale by (1 + weight) (offset_rms_norm_torch)."""
    if kernels.triton:
        from goodserve.ops.triton_ops import triton_rms_norm

        return triton_rms_norm(x, weight, eps, kernels.pdl, weight_offset)
    if layer_ops.usable(x, weight):  # float32: offset + weight first is the same arithmetic
        return layer_ops.add_rms_norm(x, None, weight + weight_offset if weight_offset else weight, eps)[0]
    if weight_offset:
        return offset_rms_norm_torch(x, weight, eps, weight_offset)
    return rms_norm_torch(x, weight, eps)


@dataclasses.dataclass(frozen=True)
class HeadNorm:
    """Qwen3's and Gemma 3's q/k norms: each head of q and of k RMS-normed over its head_dim values,
    on the rows of a qkv projection [T, (Hq + 2 Hkv) * D]."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    weight_offset: float = 0.0  # Gemma 3: scaled by (1 + weight)


def split_qkv(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The qkv projection's rows [T, (Hq + 2 Hkv) * D] as views q [T, Hq, D], k and v [T, Hkv, D]."""
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return q.view(-1, num_q_heads, head_dim), k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)


def qk_rms_norm(qkv: torch.Tensor, norm: HeadNorm, kernels: KernelChoice
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """split_qkv's q, k and v with each head of q and k RMS-normed. On the Triton path in place, one launch."""
    if kernels.triton:
        from goodserve.ops.triton_ops import triton_qk_rms_norm_

        triton_qk_rms_norm_(qkv, norm.q_weight, norm.k_weight, norm.num_q_heads, norm.num_kv_heads, norm.head_dim,
                            norm.eps, kernels.pdl, norm.weight_offset)
    q, k, v = split_qkv(qkv, norm.num_q_heads, norm.num_kv_heads, norm.head_dim)
    if not kernels.triton:
        q = rms_norm(q, norm.q_weight, norm.eps, kernels, norm.weight_offset)
        k = rms_norm(k, norm.k_weight, norm.eps, kernels, norm.weight_offset)
    return q, k, v


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, kernels: KernelChoice,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x; return (rms_norm(residual), residual). The inputs are not modified."""
    if kernels.triton:
        from goodserve.ops.triton_ops import triton_add_rms_norm

        return triton_add_rms_norm(x, residual, weight, eps, kernels.pdl, weight_offset)
    if layer_ops.usable(x, residual, weight):
        return layer_ops.add_rms_norm(x, residual, weight + weight_offset if weight_offset else weight, eps)
    if weight_offset:
        residual = x + residual
        return offset_rms_norm_torch(residual, weight, eps, weight_offset), residual
    return add_rms_norm_torch(x, residual, weight, eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in float32 whatever the activation dtype, as HF Llama does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def offset_rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """Gemma's RMSNorm: scaled by (offset + weight), all in float32 and rounded once at the end
    (transformers' Gemma RMSNorm; Llama's rounds before the scale)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.float())).to(x.dtype)


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm_torch(residual, weight, eps), residual
