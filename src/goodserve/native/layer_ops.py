"""Python side of the native layer ops (layer_ops.cpp) and decode attention (decode_attention.cpp).

Each wrapper takes what its torch reference takes and returns what it returns; callers check
`usable` first (CPU, float32, library built) and otherwise keep their torch path.
"""

from __future__ import annotations

import torch

from goodserve.native.build import library

def usable(*tensors: torch.Tensor) -> bool:
    """Whether the native ops take these tensors: float32 on the CPU, and the library built."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors) and library() is not None


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(x + residual) * weight, x + residual); without a residual, (rms_norm(x) * weight, None)."""
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    summed = None if residual is None else torch.empty_like(x)
    library().gs_add_rms_norm(x.data_ptr(), None if residual is None else residual.contiguous().data_ptr(),
                              weight.data_ptr(), out.data_ptr(), None if summed is None else summed.data_ptr(),
                              x.numel() // x.shape[-1], x.shape[-1], eps)
    return out, summed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    library().gs_silu_and_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // gate_up.shape[-1], inter)
    return out


def _token_stride(x: torch.Tensor) -> int:
    """Token stride of a [T, H, D] view whose heads and dims are packed (a slice of a qkv row)."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise ValueError("expected [T, H, D] with packed heads")
    return x.stride(0)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  rotary_cache: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """RoPE on q (in place) and k; rotated k and v into the float32 pools at slot_mapping (-1 skipped)."""
    positions, slots = positions.to(torch.int32).contiguous(), slot_mapping.to(torch.int32).contiguous()
    library().gs_rope_write_kv(q.data_ptr(), _token_stride(q), k.data_ptr(), _token_stride(k), v.data_ptr(),
                               _token_stride(v), positions.data_ptr(), rotary_cache.contiguous().data_ptr(),
                               slots.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), q.shape[0], q.shape[1],
                               k.shape[1], q.shape[2])


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D], one query per sequence at the end of its context -> [B, Hq, D]."""
    batch, heads, head_dim = q.shape
    tables, lens = block_tables.to(torch.int32), seq_lens.to(torch.int32).contiguous()
    out = torch.empty(batch, heads, head_dim, dtype=torch.float32)
    library().gs_decode_attention(q.data_ptr(), _token_stride(q), k_pool.data_ptr(), v_pool.data_ptr(),
                                  tables.data_ptr(), tables.stride(0), tables.stride(1), lens.data_ptr(),
                                  out.data_ptr(), batch, heads, k_pool.shape[2], head_dim, k_pool.shape[1],
                                  scale, torch.get_num_threads())
    return out
