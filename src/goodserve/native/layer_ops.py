"""Python side of the native layer ops (layer_ops.cpp) and decode attention (decode_attention.cpp).

Each wrapper takes what its torch reference takes and returns what it returns; callers check
`usable` first (CPU, float32, library built) and otherwise keep their torch path.
"""

from __future__ import annotations

import torch

from goodserve.native.build import library
from goodserve.native.operands import NativeOperandError, operand

F32, I32 = torch.float32, torch.int32

def usable(*tensors: torch.Tensor) -> bool:
    """Whether the native ops take these tensors: float32 on the CPU, and the library built."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors) and library() is not None


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(x + residual) * weight, x + residual); without a residual, (rms_norm(x) * weight, None)."""
    x, weight = x.contiguous(), weight.contiguous()
    operand("x", x, F32)
    operand("weight", weight, F32, (x.shape[-1],))
    if residual is not None:
        residual = operand("residual", residual.contiguous(), F32, tuple(x.shape))
    out = torch.empty_like(x)
    summed = None if residual is None else torch.empty_like(x)
    library().gs_add_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(),
                              weight.data_ptr(), out.data_ptr(), None if summed is None else summed.data_ptr(),
                              x.numel() // x.shape[-1], x.shape[-1], eps)
    return out, summed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = operand("gate_up", gate_up.contiguous(), F32)
    if gate_up.shape[-1] % 2:
        raise NativeOperandError(f"gate_up's last dimension {gate_up.shape[-1]} is not even")
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    library().gs_silu_and_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // gate_up.shape[-1], inter)
    return out


def _token_stride(name: str, x: torch.Tensor, tokens: int, heads: int | None, head_dim: int) -> int:
    """Token stride of a [T, H, D] float32 view whose heads and dims are packed (a slice of a qkv row)."""
    return operand(name, x, F32, (tokens, heads, head_dim), rows=True).stride(0)


def kv_pools(k_pool: torch.Tensor, v_pool: torch.Tensor, kv_heads: int, head_dim: int) -> None:
    """[blocks, block_size, kv_heads, head_dim] float32 K and V pools of one shape."""
    operand("k_pool", k_pool, F32, (None, None, kv_heads, head_dim))
    operand("v_pool", v_pool, F32, tuple(k_pool.shape))


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  rotary_cache: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """RoPE on q (in place) and k; rotated k and v into the float32 pools at slot_mapping (-1 skipped)."""
    tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    positions = operand("positions", positions.to(I32).contiguous(), I32, (tokens,))
    slots = operand("slot_mapping", slot_mapping.to(I32).contiguous(), I32, (tokens,))
    rotary_cache = operand("rotary_cache", rotary_cache.contiguous(), F32, (None, head_dim))
    strides = [_token_stride(name, t, tokens, heads, head_dim)
               for name, t, heads in (("q", q, q_heads), ("k", k, kv_heads), ("v", v, kv_heads))]
    kv_pools(k_pool, v_pool, kv_heads, head_dim)
    library().gs_rope_write_kv(q.data_ptr(), strides[0], k.data_ptr(), strides[1], v.data_ptr(), strides[2],
                               positions.data_ptr(), rotary_cache.data_ptr(), slots.data_ptr(), k_pool.data_ptr(),
                               v_pool.data_ptr(), tokens, q_heads, kv_heads, head_dim)


def block_tables_operand(block_tables: torch.Tensor, batch: int) -> torch.Tensor:
    """int32 [>= batch, blocks] tables, any strides (the kernels take both)."""
    tables = block_tables.to(I32)
    if tables.device.type != "cpu" or tables.dim() != 2 or tables.shape[0] < batch:
        raise NativeOperandError(f"block tables {tuple(tables.shape)} on {tables.device} do not cover "
                                 f"{batch} sequences on the CPU")
    return tables


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """q [B, Hq, D], one query per sequence at the end of its context -> [B, Hq, D]; with a window,
    each sees only its last `window` keys."""
    batch, heads, head_dim = q.shape
    q_stride = _token_stride("q", q, batch, heads, head_dim)
    kv_pools(k_pool, v_pool, None, head_dim)
    tables = block_tables_operand(block_tables, batch)
    lens = operand("seq_lens", seq_lens.to(I32).contiguous(), I32, (batch,))
    out = torch.empty(batch, heads, head_dim, dtype=torch.float32)
    library().gs_decode_attention(q.data_ptr(), q_stride, k_pool.data_ptr(), v_pool.data_ptr(),
                                  tables.data_ptr(), tables.stride(0), tables.stride(1), lens.data_ptr(),
                                  out.data_ptr(), batch, heads, k_pool.shape[2], head_dim, k_pool.shape[1],
                                  scale, window or 0, torch.get_num_threads())
    return out
