"""Rotary position embedding in the Hugging Face (rotate-half) layout, with Llama-3 or linear scaling or LongRoPE."""

from __future__ import annotations

import math

import torch

from goodserve.ops.rope_scaling import LinearRope, LongRope, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | LinearRope | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    if isinstance(scaling, LinearRope):
        return inv_freq.float() / scaling.factor
    assert isinstance(scaling, RopeScaling), "LongRoPE's frequencies depend on the position: cos_sin_cache"
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(is_mid, blended, scaled).float()


def cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | LinearRope | LongRope | None
) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half, sin in the second."""
    if isinstance(scaling, LongRope):
        return _long_rope_cache(head_dim, max_positions, theta, scaling)
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def _long_rope_cache(head_dim: int, max_positions: int, theta: float, scaling: LongRope) -> torch.Tensor:
    """Positions inside the original context rotate by the short factors, those past it by the long
    ones: a position's rotation never depends on what else is in the sequence, so a cached block
    (prefix caching, chunked prefill) means the same thing to every sequence that shares it. This is
    transformers' forward over a cache, token by token; its generate differs for a sequence that
    outgrows the original context (it then recomputes the whole sequence by the long factors, and
    rotates a prompt longer than the original context wholly by them)."""
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    split = min(scaling.original_max_position_embeddings, max_positions)
    parts = []
    for factors, positions in ((scaling.short_factor, torch.arange(split)),
                               (scaling.long_factor, torch.arange(split, max_positions))):
        inv_freq = base / torch.tensor(factors, dtype=torch.float32)
        angles = torch.outer(positions.float(), inv_freq)
        parts.append(torch.cat([angles.cos(), angles.sin()], dim=-1) * scaling.attention_factor)
    return torch.cat(parts)


def apply_rotary_torch(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D], positions: [T]. Returns rotated copies in the input dtype.

    The reference for the fused RoPE + cache write (ops/attention.py rotary_write_kv).
    """
    cos, sin = cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
