"""Attention over the paged KV cache: the batch metadata, the cache write and the plain-torch path.

One batch holds B sequences; sequence i contributes q_len_i new tokens (a prefill chunk, or 1 for
decode), laid end to end in a flat [T, ...] batch. Its context after this step is seq_len_i tokens,
so its new queries sit at positions seq_len_i - q_len_i ... seq_len_i - 1, and each attends every
cached key at a position <= its own (causal). K/V live in blocks of `block_size` token slots;
slot = block_id * block_size + offset.

The Triton kernels (ops/triton_attention.py) compute the same function; this file is their reference,
the CPU path, and the dispatch between the two (`set_attention_backend`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from goodserve.ops.rotary import apply_rotary_torch

INT8_MAX = 127.0
ATTENTION_BACKENDS = ("auto", "torch", "triton")

# Process-wide kernel choice, set once by the engine from EngineConfig.attention_backend. It governs
# every Triton kernel (attention, the RoPE + cache write, and the fused norm/activation/argmax ops).
_backend = "auto"


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int32; -1 marks a padding token whose K/V is not written
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative q lengths
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new)
    # [B, max_blocks] int32, any strides; entries past a sequence's blocks are never read for
    # attention (0 on the eager path, whatever an earlier step left in a decode graph's table).
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # Host copies, so the torch path never synchronizes with the device to read lengths.
    query_lens_host: list[int]
    seq_lens_host: list[int]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass
class LayerKVCache:
    """One layer's K and V pools: [num_blocks, block_size, num_kv_heads, head_dim].

    dtype is the model's, int8 (with a float32 scale per token slot and head), or float8_e4m3fn.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads], int8 only
    v_scale: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.k.shape[1]


def quantize_int8_per_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H, D] -> (int8 values, float32 scale [T, H]) with x ~= values * scale."""
    scale = x.float().abs().amax(dim=-1).clamp(min=1e-8) / INT8_MAX
    values = torch.round(x.float() / scale.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return values, scale


def set_attention_backend(name: str) -> None:
    """"auto": Triton on CUDA tensors, torch elsewhere; "torch": never Triton; "triton": always Triton
    (CPU tensors then need TRITON_INTERPRET=1, which is how the kernel tests run)."""
    global _backend
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "triton" and not triton_available():
        raise RuntimeError("attention_backend='triton' needs the triton package")
    _backend = name


def get_attention_backend() -> str:
    return _backend


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """Whether the op about to run on x should take its Triton kernel."""
    if _backend == "torch":
        return False
    if _backend == "triton":
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("attention_backend='triton' on CPU tensors needs TRITON_INTERPRET=1")
        return True
    return x.is_cuda and triton_available()


def rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    rotary_cache: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
    """RoPE on q ([T, Hq, D], in place) and k; then the new tokens' K/V ([T, Hk, D]) into their
    slots, quantized for an int8/fp8 cache. One fused kernel on the Triton path."""
    if use_triton(q):
        from goodserve.ops.triton_attention import triton_rotary_write_kv

        triton_rotary_write_kv(q, k, v, positions, rotary_cache, cache, slot_mapping)
    else:
        rotary_write_kv_torch(q, k, v, positions, rotary_cache, cache, slot_mapping)


def paged_attention(q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D], attending this step's context (K/V already written)."""
    if not use_triton(q):
        return paged_attention_torch(q, cache, meta, scale)
    from goodserve.ops.triton_attention import triton_decode_attention, triton_prefill_attention

    if meta.is_decode_only:
        return triton_decode_attention(q, cache, meta.block_tables, meta.seq_lens, scale)
    return triton_prefill_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale)


def rotary_write_kv_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          rotary_cache: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
    """The reference: rotate q and k, store the rotated k and v."""
    rotated_q, rotated_k = apply_rotary_torch(q, k, positions, rotary_cache)
    q.copy_(rotated_q)
    write_kv_torch(rotated_k, v, cache, slot_mapping)


def write_kv_torch(k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
    """The reference cache write."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k, v = k[keep], v[keep]
    num_kv_heads, head_dim = cache.k.shape[2], cache.k.shape[3]
    flat_k = cache.k.view(-1, num_kv_heads, head_dim)
    flat_v = cache.v.view(-1, num_kv_heads, head_dim)
    if cache.k_scale is None:
        flat_k[slots] = k.to(cache.k.dtype)
        flat_v[slots] = v.to(cache.v.dtype)
        return
    for x, flat, flat_scale in ((k, flat_k, cache.k_scale), (v, flat_v, cache.v_scale)):
        values, scale = quantize_int8_per_head(x)
        flat[slots] = values
        flat_scale.view(-1, num_kv_heads)[slots] = scale


def gather_kv(cache: LayerKVCache, block_ids: torch.Tensor, length: int, dtype: torch.dtype):
    """The first `length` tokens' K and V of one sequence, [length, Hk, D], dequantized to dtype."""

    # index_select, not pool[block_ids]: on the CPU it gathers blocks several times faster.
    def gather(pool: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        x = pool.index_select(0, block_ids).flatten(0, 1)[:length]
        if scale is None:
            return x.to(dtype)
        return (x.float() * scale.index_select(0, block_ids).flatten(0, 1)[:length].unsqueeze(-1)).to(dtype)

    return gather(cache.k, cache.k_scale), gather(cache.v, cache.v_scale)


def paged_attention_reference(
    q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]. One sequence at a time; the definition the kernels must match."""
    out = torch.empty_like(q)
    block_size = cache.block_size
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        num_blocks = -(-seq_len // block_size)
        k, v = gather_kv(cache, meta.block_tables[i, :num_blocks].long(), seq_len, q.dtype)
        out[start : start + q_len] = _causal_attention(q[start : start + q_len], k, v, scale)
        start += q_len
    return out


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [Lq, Hq, D] are the last Lq of the Lk positions in k, v: [Lk, Hk, D]."""
    q_len, k_len = q.shape[0], k.shape[0]
    query_pos = torch.arange(k_len - q_len, k_len, device=q.device).unsqueeze(1)
    mask = torch.arange(k_len, device=q.device).unsqueeze(0) <= query_pos  # [Lq, Lk]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)


def decode_attention_torch(
    q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Decode-only batch (one query per sequence), vectorized over the batch: the CPU fast path."""
    batch = q.shape[0]
    max_blocks = -(-meta.max_seq_len // cache.block_size)
    block_ids = meta.block_tables[:, :max_blocks].long()
    k, v = gather_kv(cache, block_ids.flatten(), batch * max_blocks * cache.block_size, q.dtype)
    k = k.view(batch, -1, *k.shape[1:]).transpose(1, 2)  # [B, Hk, L, D]
    v = v.view(batch, -1, *v.shape[1:]).transpose(1, 2)
    positions = torch.arange(k.shape[2], device=q.device)
    mask = (positions.unsqueeze(0) < meta.seq_lens.unsqueeze(1).to(q.device))[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.squeeze(2)


def paged_attention_torch(
    q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    if meta.is_decode_only:
        return decode_attention_torch(q, cache, meta, scale)
    return paged_attention_reference(q, cache, meta, scale)
