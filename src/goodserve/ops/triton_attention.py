"""Triton kernels for the paged KV cache: RoPE + cache write, decode attention and prefill attention.

They compute exactly the functions defined in ops/attention.py and ops/rotary.py (rotary_write_kv_torch,
paged_attention_reference) on the same layout: K/V pools [num_blocks, block_size, Hk, D], int8 pools
with a float32 scale per (slot, head), or float8_e4m3fn pools without one.

Every launch is CUDA-graph safe: grids depend only on tensor shapes and a fixed split count, and
loop bounds come from the seq_lens / query_start_loc tensors, never from host copies. Block tables
may be strided in both dimensions (the decode graphs keep theirs column-major).

The interpreter (TRITON_INTERPRET=1, CPU tensors) multiplies bf16 tiles as raw uint16 bit patterns,
so on CPU tensors the dot operands are upcast to float32 (UPCAST_DOT); GPU launches keep bf16 dots.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from goodserve.ops.pdl import pdl_launch, pdl_sync

LOG2E = 1.4426950408889634
# Adding then subtracting 1.5 * 2**23 rounds a float32 |x| < 2**22 to the nearest even integer,
# matching torch.round without libdevice (which the interpreter lacks).
ROUND_MAGIC = tl.constexpr(12582912.0)

# How a pool stores values; fp8 pools have no scale: cast on store and load.
KV_PLAIN = tl.constexpr(0)
KV_INT8 = tl.constexpr(1)
KV_FP8 = tl.constexpr(2)


# ---------------------------------------------------------------------------------------------
# RoPE + cache write in one launch: a program per token rotates its q heads in place, rotates its
# k heads on their way into the cache and stores v. Head vectors are handled as their two
# rotate-half halves, so each thread reads and writes the same q elements (in place is safe).


@triton.jit
def _load_halves(row_ptr, d, half, mask):
    """[H, HALF] first and second halves of the head vectors starting at row_ptr [H, 1]."""
    return tl.load(row_ptr + d, mask=mask, other=0.0), tl.load(row_ptr + half + d, mask=mask, other=0.0)


@triton.jit
def _rotate(x1, x2, cos, sin, dtype: tl.constexpr):
    """Rotate-half RoPE in float32, rounded to dtype as the torch reference rounds it."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    return (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)


@triton.jit
def _to_int8(x, scale):
    rounded = (x / scale[:, None] + ROUND_MAGIC) - ROUND_MAGIC
    return tl.minimum(tl.maximum(rounded, -127.0), 127.0).to(tl.int8)


@triton.jit
def _store_kv(lo, hi, cache_ptr, scale_ptr, slot, h, d, half, num_heads, mask, KV_QUANT: tl.constexpr):
    """One token's head vectors (as halves [H, HALF]) into its cache slot, quantized for int8 / fp8."""
    dst = cache_ptr + (slot * num_heads + h[:, None]) * (2 * half) + d
    if KV_QUANT == KV_INT8:  # one float32 scale per (slot, head), from the absmax over both halves
        lo = lo.to(tl.float32)
        hi = hi.to(tl.float32)
        scale = tl.maximum(tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1)), 1e-8) / 127.0
        tl.store(dst, _to_int8(lo, scale), mask=mask)
        tl.store(dst + half, _to_int8(hi, scale), mask=mask)
        tl.store(scale_ptr + slot * num_heads + h, scale, mask=h < num_heads)
    elif KV_QUANT == KV_FP8:  # round to nearest like torch's cast (the interpreter's default truncates)
        tl.store(dst, lo.to(cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(dst + half, hi.to(cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    else:
        tl.store(dst, lo.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + half, hi.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_write_kv_kernel(q_ptr, k_ptr, v_ptr, positions_ptr, rotary_ptr, slot_ptr, k_cache, v_cache,
                            k_scale, v_scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                            stride_rotary, num_q_heads, num_kv_heads, HALF: tl.constexpr,
                            BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                            KV_QUANT: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_sync(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(rotary_ptr + pos * stride_rotary + d, mask=d < HALF, other=0.0)
    sin = tl.load(rotary_ptr + pos * stride_rotary + HALF + d, mask=d < HALF, other=0.0)

    hq = tl.arange(0, BLOCK_HQ)
    q_mask = (hq[:, None] < num_q_heads) & (d < HALF)
    q_rows = q_ptr + token * stride_qt + hq[:, None] * stride_qh
    q1, q2 = _load_halves(q_rows, d, HALF, q_mask)
    q1, q2 = _rotate(q1, q2, cos, sin, q_ptr.dtype.element_ty)
    tl.store(q_rows + d, q1, mask=q_mask)
    tl.store(q_rows + HALF + d, q2, mask=q_mask)

    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # -1 marks padding: nothing to store
        hk = tl.arange(0, BLOCK_HK)
        kv_mask = (hk[:, None] < num_kv_heads) & (d < HALF)
        k1, k2 = _load_halves(k_ptr + token * stride_kt + hk[:, None] * stride_kh, d, HALF, kv_mask)
        k1, k2 = _rotate(k1, k2, cos, sin, k_ptr.dtype.element_ty)
        _store_kv(k1, k2, k_cache, k_scale, slot, hk, d, HALF, num_kv_heads, kv_mask, KV_QUANT)
        v1, v2 = _load_halves(v_ptr + token * stride_vt + hk[:, None] * stride_vh, d, HALF, kv_mask)
        _store_kv(v1, v2, v_cache, v_scale, slot, hk, d, HALF, num_kv_heads, kv_mask, KV_QUANT)


def triton_rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                           rotary_cache: torch.Tensor, cache, slot_mapping: torch.Tensor, pdl: bool = False) -> None:
    """q: [T, Hq, D] rotated in place; k (rotated) and v: [T, Hk, D] into the cache slots (-1 skipped).

    Views into a fused qkv projection are fine: only the head dim must be contiguous.
    rotary_cache: [P, D] float32, cos in the first half of each row, sin in the second.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    _check_cache(cache)
    assert all(x.stride(-1) == 1 for x in (q, k, v, rotary_cache)), "the head dim must be contiguous"
    assert head_dim % 2 == 0, "rotate-half RoPE needs an even head dim"
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_write_kv_kernel[(num_tokens,)](
        q, k, v, positions, rotary_cache, slot_mapping, cache.k, cache.v, *_scales(cache),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), rotary_cache.stride(0),
        num_q_heads, num_kv_heads, half,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half), KV_QUANT=_kv_quant(cache), num_warps=4,
        **pdl_launch(pdl),
    )


# ---------------------------------------------------------------------------------------------
# Shared pieces of the attention kernels


@triton.jit
def _load_kv_tile(cache_ptr, slot, kv_head, num_kv_heads, HEAD_DIM, tok_mask, d, d_mask,
                  COMPUTE_DTYPE: tl.constexpr):
    """[BLOCK_N, BLOCK_D] cached values in the compute dtype (int8 and fp8 convert exactly)."""
    offs = slot[:, None] * (num_kv_heads * HEAD_DIM) + kv_head * HEAD_DIM + d[None, :]
    return tl.load(cache_ptr + offs, mask=tok_mask[:, None] & d_mask[None, :], other=0.0).to(COMPUTE_DTYPE)


@triton.jit
def _load_scales(scale_ptr, slot, kv_head, num_kv_heads, tok_mask):
    return tl.load(scale_ptr + slot * num_kv_heads + kv_head, mask=tok_mask, other=0.0)


@triton.jit
def _soft_cap(s, cap):
    """tanh(s / cap) * cap, tanh as 1 - 2 / (exp(2x) + 1): exact at both ends (exp's overflow to inf
    gives 1, its underflow to 0 gives -1), and the interpreter has no tanh of its own."""
    return (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0)) * cap


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_cache, v_cache, k_scale, v_scale, slot, kv_head, num_kv_heads,
                 HEAD_DIM, tok_mask, key_mask, d, d_mask, qk_scale, softcap,
                 COMPUTE_DTYPE: tl.constexpr, KV_QUANT: tl.constexpr, UPCAST_DOT: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """One online-softmax step over a key tile.

    tok_mask [BLOCK_N]: keys that exist; key_mask [BLOCK_M or 1, BLOCK_N]: keys each row may see.
    Scores live in the log2 domain (scaled by log2 e) so the exponentials are exp2. With SOFTCAP,
    each score s becomes tanh(s / softcap) * softcap first (softcap scaled by log2 e too).
    """
    k = _load_kv_tile(k_cache, slot, kv_head, num_kv_heads, HEAD_DIM, tok_mask, d, d_mask, COMPUTE_DTYPE)
    if UPCAST_DOT:
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if KV_QUANT == KV_INT8:
        # Scales multiply the scores and probabilities rather than the tiles: int8 is exact in bf16.
        qk = qk * _load_scales(k_scale, slot, kv_head, num_kv_heads, tok_mask)[None, :]
    qk = qk * qk_scale
    if SOFTCAP:
        qk = _soft_cap(qk, softcap)  # a cap in the log2 domain too: tanh(s / c) * c scales with both
    qk = tl.where(key_mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    # A row that has seen no key yet (a sliding window's first tiles can hide every key from some
    # rows) keeps m = -inf; subtracting 0 instead keeps its exponentials 0, not NaN (-inf - -inf).
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(qk - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = _load_kv_tile(v_cache, slot, kv_head, num_kv_heads, HEAD_DIM, tok_mask, d, d_mask, COMPUTE_DTYPE)
    if KV_QUANT == KV_INT8:
        p = p * _load_scales(v_scale, slot, kv_head, num_kv_heads, tok_mask)[None, :]
    if UPCAST_DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE_DTYPE), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _slots_of(block_table_row, stride_bb, pos, valid, BLOCK_SIZE: tl.constexpr):
    block = tl.load(block_table_row + (pos // BLOCK_SIZE) * stride_bb, mask=valid, other=0).to(tl.int64)
    return block * BLOCK_SIZE + pos % BLOCK_SIZE


# ---------------------------------------------------------------------------------------------
# Decode: one query per sequence; one program per (KV head, sequence, split) covers the whole
# GQA group, so every K/V tile is read once per group. KV heads vary fastest in the grid: a
# sequence's programs run side by side and read its tokens' K/V rows (all heads of a token are
# adjacent in the pool) at about the same time; the ShareGPT-like run did 0.8% more requests/s so
# than with sequences first (benchmarks/results/gpu_engine_headsfirst_h100.json, H100; alone, the
# kernel gained under 1%). Splits cover contiguous key ranges sized
# from the sequence's actual length (the grid is sized for the longest possible one): a short
# context spreads over fewer, but still several, splits of >= SPLIT_KEYS keys and the splits past
# it exit at once. A sequence that fits one split writes its output directly; otherwise each split
# stores a partial result and the last of the group to finish merges them by log-sum-exp
# (flash-decoding's reduce, without a second kernel). Contexts up to DIRECT_KEYS always take one
# split: at batch 1 a short context is latency, not bytes, and the merge is the longest chain.
# With ROTARY (a decode-only step), the kernel also does _rotary_write_kv_kernel's work for its
# decode tokens: every program rotates its group's queries itself, and the program whose split
# holds the new position writes that token's K/V before reading it back: one launch a layer less.


@triton.jit
def _merge_splits(out_ptr, part_out_ptr, part_lse_ptr, seq, kv_head, num_used, num_q_heads, stride_ot, stride_oh,
                  HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    used = s < num_used  # every used split has keys, so its log-sum-exp is finite
    for g in tl.static_range(GROUP):  # unrolled, so the heads' loads are in flight together
        head = kv_head * GROUP + g
        part = (seq * num_q_heads + head) * NUM_SPLITS + s
        # .cg reads L2, where the other programs' stores landed, never a stale L1 line.
        lse = tl.load(part_lse_ptr + part, mask=used, other=float("-inf"), cache_modifier=".cg")
        weight = tl.exp2(lse - tl.max(lse, axis=0))
        parts = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :],
                        mask=used[:, None] & (d < HEAD_DIM)[None, :], other=0.0, cache_modifier=".cg")
        out = tl.sum(parts * weight[:, None], axis=0) / tl.sum(weight, axis=0)
        tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
                 mask=d < HEAD_DIM)


@triton.jit
def _rotated_queries(rows_ptr, rotary_row, d, row_mask, HALF: tl.constexpr, HEAD_DIM: tl.constexpr):
    """[BLOCK_G, BLOCK_D] query rows (rows_ptr [BLOCK_G, 1]) rotated exactly as _rotary_write_kv_kernel
    rotates them: each element meets its rotate-half partner (loaded a second time, from L1) and its
    frequency's cos / sin in float32, then rounds to the query dtype."""
    first = d < HALF
    partner = tl.where(first, d + HALF, d - HALF)
    freq = tl.where(first, d, d - HALF)
    x = tl.load(rows_ptr + d[None, :], mask=row_mask, other=0.0).to(tl.float32)
    y = tl.load(rows_ptr + partner[None, :], mask=row_mask, other=0.0).to(tl.float32)
    cos = tl.load(rotary_row + freq, mask=d < HEAD_DIM, other=0.0)[None, :]
    sin = tl.load(rotary_row + HALF + freq, mask=d < HEAD_DIM, other=0.0)[None, :]
    # x cos - y sin in the first half, x cos + y sin in the second (x the element, y its partner) as
    # one sum of two single-use products, the shape of _rotate's: a compiler that contracts the sum
    # into an FMA does so alike in both kernels (negating y is exact), so the bits agree.
    return (x * cos + tl.where(first[None, :], -y, y) * sin).to(rows_ptr.dtype.element_ty)


@triton.jit
def _new_kv(k_row, v_row, stride_kh, stride_vh, slot_ptr, rotary_row, kv_head, HALF: tl.constexpr,
            BLOCK_HALF: tl.constexpr):
    """One decode token's K (rotated, as _rotary_write_kv_kernel rotates it) and V of one KV head, as
    [1, BLOCK_HALF] halves, its slot, and rotary_row. Independent loads are issued first: a load whose
    address waits on another (cos / sin on the position) stalls every load after it."""
    hk = kv_head + tl.arange(0, 1)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = d < HALF
    slot = tl.load(slot_ptr).to(tl.int64)
    k1, k2 = _load_halves(k_row + hk[:, None] * stride_kh, d, HALF, mask)
    v1, v2 = _load_halves(v_row + hk[:, None] * stride_vh, d, HALF, mask)
    cos = tl.load(rotary_row + d, mask=mask, other=0.0)
    sin = tl.load(rotary_row + HALF + d, mask=mask, other=0.0)
    k1, k2 = _rotate(k1, k2, cos, sin, k_row.dtype.element_ty)
    return k1, k2, v1, v2, slot, rotary_row


@triton.jit
def _store_new_kv(k1, k2, v1, v2, slot, k_cache, v_cache, k_scale, v_scale, kv_head, num_kv_heads,
                  HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, KV_QUANT: tl.constexpr):
    """_new_kv's K and V into their cache slot as _rotary_write_kv_kernel stores them; the barrier
    makes the stores visible to the program's own threads, whose tile loads then read them back
    like any cached key."""
    if slot >= 0:  # -1 marks padding: nothing to store
        hk = kv_head + tl.arange(0, 1)
        d = tl.arange(0, BLOCK_HALF)[None, :]
        mask = d < HALF
        _store_kv(k1, k2, k_cache, k_scale, slot, hk, d, HALF, num_kv_heads, mask, KV_QUANT)
        _store_kv(v1, v2, v_cache, v_scale, slot, hk, d, HALF, num_kv_heads, mask, KV_QUANT)
    tl.debug_barrier()


# Arguments that change from step to step are not specialized on (Triton would otherwise compile a
# variant for each new "== 1" / "divisible by 16" combination, hundreds of ms in the middle of a run).
@triton.jit(do_not_specialize=["stride_bt", "stride_bb", "DIRECT_KEYS", "window"])
def _decode_kernel(q_ptr, out_ptr, part_out_ptr, part_lse_ptr, arrivals_ptr, k_cache, v_cache, k_scale, v_scale,
                   block_tables, seq_lens, num_decodes_ptr, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_bt, stride_bb, num_kv_heads, window, softcap,
                   k_ptr, v_ptr, positions_ptr, rotary_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                   stride_rotary, HEAD_DIM: tl.constexpr,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, SPLIT_KEYS: tl.constexpr, DIRECT_KEYS,
                   NUM_SPLITS: tl.constexpr, KV_QUANT: tl.constexpr, UPCAST_DOT: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, BOUNDED: tl.constexpr, ROTARY: tl.constexpr,
                   BLOCK_HALF: tl.constexpr, SOFTCAP: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_sync(USE_PDL)
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    if ROTARY:  # every program, before the lengths arrive: these loads overlap seq_len's
        new_k1, new_k2, new_v1, new_v2, new_slot, rotary_row = _new_kv(
            k_ptr + seq * stride_kt, v_ptr + seq * stride_vt, stride_kh, stride_vh, slot_ptr + seq,
            rotary_ptr + tl.load(positions_ptr + seq).to(tl.int64) * stride_rotary, kv_head, HEAD_DIM // 2,
            BLOCK_HALF)
    # The keys it sees: [first_key, seq_len), the last `window` of them with a sliding window (0: none).
    first_key = tl.where((window > 0) & (seq_len > window), seq_len - window, 0)
    num_keys = seq_len - first_key
    split_keys = tl.maximum(tl.cdiv(tl.cdiv(num_keys, NUM_SPLITS), SPLIT_KEYS), 1) * SPLIT_KEYS
    # Up to DIRECT_KEYS keys, one split takes them all and writes its output itself: no partials, no
    # arrival counter, no merge (those cost several dependent memory round trips). A plain argument,
    # not a constexpr: the values to compare share one compiled kernel.
    split_keys = tl.where(num_keys <= DIRECT_KEYS, tl.maximum(num_keys, 1), split_keys)
    num_used = tl.maximum(tl.cdiv(num_keys, split_keys), 1)  # a zero-length (padding) sequence writes zeros
    active = split < num_used
    if BOUNDED:  # the rows past the first num_decodes are someone else's: leave them alone
        active = active & (seq < tl.load(num_decodes_ptr))
    if active:
        key_begin = first_key + split * split_keys
        key_end = tl.minimum(key_begin + split_keys, seq_len)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        head = kv_head * GROUP + g
        row_mask = (g < GROUP)[:, None] & d_mask[None, :]
        if ROTARY:
            q = _rotated_queries(q_ptr + seq * stride_qt + head[:, None] * stride_qh, rotary_row, d, row_mask,
                                 HEAD_DIM // 2, HEAD_DIM)
            if split == num_used - 1:  # the split holding the new token's key writes it, then reads it back
                _store_new_kv(new_k1, new_k2, new_v1, new_v2, new_slot, k_cache, v_cache, k_scale, v_scale, kv_head,
                              num_kv_heads, HEAD_DIM // 2, BLOCK_HALF, KV_QUANT)
        else:
            q = tl.load(q_ptr + seq * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_mask, other=0.0)
        if UPCAST_DOT:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        block_table_row = block_tables + seq.to(tl.int64) * stride_bt
        for start in range(key_begin, key_end, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            valid = pos < key_end
            slot = _slots_of(block_table_row, stride_bb, pos, valid, BLOCK_SIZE)
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache, v_cache, k_scale, v_scale, slot, kv_head,
                                         num_kv_heads, HEAD_DIM, valid, valid[None, :], d, d_mask, qk_scale, softcap,
                                         q_ptr.dtype.element_ty, KV_QUANT, UPCAST_DOT, DOT_PRECISION, SOFTCAP)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if num_used == 1:
            dst = out_ptr + seq * stride_ot + head[:, None] * stride_oh + d[None, :]
            tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask)
        elif NUM_SPLITS > 1:  # (compiled out of single-split launches)
            num_q_heads = num_kv_heads * GROUP
            part = (seq * num_q_heads + head) * NUM_SPLITS + split  # [B, Hq, S] index
            tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=row_mask)
            tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=g < GROUP)
            # Every thread's stores precede the (release) arrival; the last arrival (acquire) merges.
            tl.debug_barrier()
            arrivals = arrivals_ptr + seq * num_kv_heads + kv_head
            if tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu") == num_used - 1:
                tl.store(arrivals, 0)  # zero again for the next launch (or graph replay)
                _merge_splits(out_ptr, part_out_ptr, part_lse_ptr, seq, kv_head, num_used, num_q_heads,
                              stride_ot, stride_oh, HEAD_DIM, GROUP, NUM_SPLITS, BLOCK_D)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed per-(sequence, KV head) arrival counters; every launch leaves them zeroed again.

    Kept for the life of the process: a captured graph keeps using the buffer it was captured with.
    """
    assert not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()), \
        "run decode attention once before capturing it, so its counters exist outside the graph"
    return torch.zeros(count, dtype=torch.int32, device=device)


def default_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device,
                       split_keys: int, waves: int = 2) -> int:
    """Splits that fill the GPU about `waves` times over, from shapes only (so a captured graph stays
    valid). The engine passes KernelOptions.decode_attention_waves.

    max_context is the block table's capacity, not any sequence's length: the kernel sizes each
    launch's splits from the actual lengths, so a generous count costs short contexts nothing.
    """
    if device.type != "cuda":
        return 1
    # Alone, filling it once was faster from batch 4 to 32 at 500-1000 keys (H100,
    # benchmarks/results/gpu_kernels_decode_sweep_h100.json); inside the engine's ShareGPT-like run
    # it was slower (decode steps at batch 9-64: 7.66 ms in gpu_engine_routing_h100.json against
    # 7.45 in gpu_engine_pdl_h100.json, two calls on the same card kind), so twice over stays.
    wanted = triton.cdiv(waves * _num_sms(device.index or 0), batch * num_kv_heads)
    by_length = triton.cdiv(max_context, split_keys)
    return min(triton.next_power_of_2(wanted), 32, triton.next_power_of_2(by_length))


def prefill_num_splits(programs: int, max_keys: int, device: torch.device, split_keys: int, waves: int = 2) -> int:
    """Splits of a prefill launch's key ranges, from its grid of `programs` (query blocks x KV heads,
    a bound from shapes: a captured graph stays valid): decode's rule (default_num_splits, at most 16)
    where the programs would fill under a third of `waves`; else 1 (a launch whose programs mostly
    exit at once, as a mixed graph's surplus do, would only multiply those)."""
    if device.type != "cuda" or 3 * programs >= waves * _num_sms(device.index or 0):
        return 1
    return min(default_num_splits(programs, 1, max_keys, device, split_keys, waves), 16)


# Launch settings on sm_90; `tuning` overrides them. SPLIT_KEYS: the fewest keys a decode split takes;
# DIRECT_KEYS: contexts up to this many keys take one split (KernelOptions.decode_attention_tuning_by_batch
# sets it per batch size).
DECODE_TUNING = {"BLOCK_N": 64, "SPLIT_KEYS": 64, "DIRECT_KEYS": 0, "num_warps": 4, "num_stages": 3}
# Tiles by a sweep on an H100 (`gpu_kernels.py --prefill-sweep`,
# benchmarks/results/gpu_kernels_prefill_sweep_h100.json): 64 x 64 with 4 warps beat 128 x 64 with 8
# on every bf16 case, verify steps (5 queries a sequence) and 512-2K prompts alike, by 8-30%.
PREFILL_TUNING = {"BLOCK_M": 64, "BLOCK_N": 64, "SPLIT_KEYS": 512, "num_warps": 4, "num_stages": 2}
# float32 dots are exact ("ieee"), so they run on the FMA units, not the tensor cores, where large
# tiles spill registers: 128 x 64 made an embedded-model verify step 11.3 ms against 1.3 for its
# decode step (benchmarks/results/gpu_spec_decode_small_verify_h100.json); 16 x 64 is the fastest
# in the same sweep on every float32 case, 4-50x faster than 128 x 64.
PREFILL_TUNING_FLOAT32 = {"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_KEYS": 512, "num_warps": 4, "num_stages": 2}
# The interpreter runs every element in numpy: small tiles keep CPU tests fast.
INTERPRETER_TUNING = {"BLOCK_M": 16, "BLOCK_N": 16, "SPLIT_KEYS": 16, "DIRECT_KEYS": 0, "num_warps": 4,
                      "num_stages": 1}


def _tuning(q: torch.Tensor, defaults: dict, tuning: dict | None) -> dict:
    return {**(defaults if q.is_cuda else INTERPRETER_TUNING), **(tuning or {})}


class NewTokens(NamedTuple):
    """A decode step's new tokens, for decode attention to rotate and write itself (`new_tokens`):
    k, v [B, Hk, D] as the projection left them, positions [B], rotary_cache [P, D] (cos | sin),
    slot_mapping [B] (-1: padding)."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    rotary_cache: torch.Tensor
    slot_mapping: torch.Tensor


def triton_decode_attention(q: torch.Tensor, cache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float, num_splits: int | None = None, tuning: dict | None = None,
                            out: torch.Tensor | None = None, num_decodes: torch.Tensor | None = None,
                            pdl: bool = False, waves: int = 2, new_tokens: NewTokens | None = None,
                            window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q: [B, Hq, D], one query per sequence -> [B, Hq, D] (into `out` when given).
    window: a sliding window, each query sees only its last `window` keys; softcap: scores s become
    tanh(s / softcap) * softcap.
    num_splits: a power of two, or None (default_num_splits, filling the GPU `waves` times over).
    num_decodes: an int32 device scalar; only the first
    num_decodes sequences are computed, the other rows of `out` are left as they are (a mixed
    graph's decodes, whose count the host does not know when the launch is recorded).
    new_tokens: RoPE and the cache write fused in (what triton_rotary_write_kv would do first): q is
    then taken unrotated and left so, and the new K/V land in the cache as that kernel stores them.
    tuning: DECODE_TUNING overrides; DIRECT_KEYS (default 0): contexts up to it take one split."""
    batch, num_q_heads, head_dim = q.shape
    _check_cache(cache)
    assert seq_lens.shape[0] == batch, "decode attention takes exactly one query per sequence"
    num_kv_heads, block_size = cache.k.shape[2], cache.k.shape[1]
    group = num_q_heads // num_kv_heads
    tune = _tuning(q, DECODE_TUNING, tuning)
    if num_splits is None:
        max_keys = block_tables.shape[1] * block_size
        num_splits = default_num_splits(batch, num_kv_heads, min(max_keys, window or max_keys), q.device,
                                        tune["SPLIT_KEYS"], waves)
    assert num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    out = torch.empty_like(q) if out is None else out
    part_out = part_lse = arrivals = out  # unused when num_splits == 1
    if num_splits > 1:
        part_out = torch.empty(batch, num_q_heads, num_splits, head_dim, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(batch, num_q_heads, num_splits, device=q.device, dtype=torch.float32)
        arrivals = _arrival_counters(q.device, batch * num_kv_heads)
    if new_tokens is None:  # stand-ins: the kernel takes pointers either way
        k, v, positions, rotary_cache, slot_mapping = q, q, seq_lens, q[0], seq_lens
    else:
        k, v, positions, rotary_cache, slot_mapping = new_tokens
        assert num_decodes is None and head_dim % 2 == 0, "fused RoPE: a decode-only batch, an even head dim"
        assert all(x.stride(-1) == 1 for x in (q, k, v, rotary_cache)), "the head dim must be contiguous"
    _decode_kernel[(num_kv_heads, batch, num_splits)](
        q, out, part_out, part_lse, arrivals, cache.k, cache.v,
        *_scales(cache),
        block_tables, seq_lens, seq_lens if num_decodes is None else num_decodes, scale * LOG2E, q.stride(0),
        q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), block_tables.stride(1), num_kv_heads,
        window or 0, (softcap or 0.0) * LOG2E, k, v, positions, rotary_cache, slot_mapping, k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        rotary_cache.stride(0),
        head_dim, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=tune["BLOCK_N"], BLOCK_SIZE=block_size,
        SPLIT_KEYS=tune["SPLIT_KEYS"], DIRECT_KEYS=tune["DIRECT_KEYS"], NUM_SPLITS=num_splits,
        KV_QUANT=_kv_quant(cache), UPCAST_DOT=not q.is_cuda, DOT_PRECISION=_dot_precision(q.dtype),
        BOUNDED=num_decodes is not None, ROTARY=new_tokens is not None,
        BLOCK_HALF=triton.next_power_of_2(max(head_dim // 2, 1)), SOFTCAP=softcap is not None,
        num_warps=tune["num_warps"],
        num_stages=tune["num_stages"], **pdl_launch(pdl),
    )
    return out


# ---------------------------------------------------------------------------------------------
# Prefill / mixed batches: FlashAttention-style tiles over a varlen batch. A program owns BLOCK_Q
# query tokens of one sequence times all GROUP query heads of one KV head (BLOCK_M rows), so K/V
# tiles are shared by the group. Programs map to sequences through query_start_loc: the grid is
# T // BLOCK_Q + B programs (an upper bound from shapes alone), surplus programs exit at once.
# A batch's leading one-query sequences (decodes beside prefill chunks) can be left to the decode
# kernel (first_seq): here each would use GROUP of a tile's BLOCK_M rows.
# A launch of few tokens (a prefix hit's question) would run few programs, each reading its
# sequence's whole context alone: with NUM_SPLITS > 1 (chosen from the launch's grid,
# prefill_num_splits) each block's keys spread over up to NUM_SPLITS programs of >= SPLIT_KEYS keys,
# and the last of them to finish merges their partial results, as decode attention does.


@triton.jit
def _first_block(query_start_loc, seq, first_seq, first_token, BLOCK_Q: tl.constexpr):
    """Index of the first query block of `seq`, counting from sequence first_seq (whose first token is
    first_token): each sequence's blocks start where the previous one's (rounded up) end."""
    return (tl.load(query_start_loc + seq) - first_token) // BLOCK_Q + seq - first_seq


@triton.jit
def _find_sequence(query_start_loc, first_seq, first_token, num_seqs, program, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks include `program`."""
    lo = first_seq
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if _first_block(query_start_loc, mid, first_seq, first_token, BLOCK_Q) <= program:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# The same per-step arguments, plus the sequence counts. first_seq is an int, or with
# FIRST_SEQ_IN_MEMORY a pointer to it.
@triton.jit(do_not_specialize=["stride_bt", "stride_bb", "first_seq", "num_seqs", "window"])
def _prefill_kernel(q_ptr, out_ptr, part_out_ptr, part_lse_ptr, arrivals_ptr, k_cache, v_cache, k_scale, v_scale,
                    block_tables, seq_lens,
                    query_start_loc, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_bb,
                    first_seq, num_seqs, num_kv_heads, window, softcap, HEAD_DIM: tl.constexpr,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT_KEYS: tl.constexpr,
                    NUM_SPLITS: tl.constexpr, KV_QUANT: tl.constexpr,
                    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, FIRST_SEQ_IN_MEMORY: tl.constexpr,
                    SOFTCAP: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_sync(USE_PDL)
    if FIRST_SEQ_IN_MEMORY:
        first_seq = tl.load(first_seq)
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    first_seq_token = tl.load(query_start_loc + first_seq)
    seq = _find_sequence(query_start_loc, first_seq, first_seq_token, num_seqs, program, BLOCK_Q)
    q_begin = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_begin
    first_token = (program - _first_block(query_start_loc, seq, first_seq, first_seq_token, BLOCK_Q)) * BLOCK_Q
    if first_token < q_len:
        seq_len = tl.load(seq_lens + seq)
        context = seq_len - q_len  # tokens cached before this step's queries

        rows = tl.arange(0, BLOCK_M)
        token = first_token + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_valid = (rows < BLOCK_Q * GROUP) & (token < q_len)
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        io_mask = row_valid[:, None] & d_mask[None, :]
        q_tok = (q_begin + token).to(tl.int64)
        q = tl.load(q_ptr + q_tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=io_mask, other=0.0)
        if UPCAST_DOT:
            q = q.to(tl.float32)
        query_pos = context + token
        # Keys past the block's last query are never visible to it, nor (with a sliding window, 0:
        # none) keys `window` or more before its first query.
        key_end = context + tl.minimum(first_token + BLOCK_Q, q_len)
        key_begin = tl.where(window > 0, tl.maximum(context + first_token - window + 1, 0), 0)
        oldest_key = tl.where(window > 0, query_pos - window + 1, 0)  # [BLOCK_M], per query row
        block_table_row = block_tables + seq.to(tl.int64) * stride_bt
        # (the output's addresses come after each branch's loop: live across it they cost registers)
        if NUM_SPLITS == 1:  # one program a block, all of its keys (every launch but a few programs')
            m_i, l_i, acc = _attend_keys(q, key_begin, key_end, block_table_row, stride_bb, query_pos, oldest_key,
                                         k_cache, v_cache, k_scale, v_scale, kv_head, num_kv_heads, d, d_mask,
                                         qk_scale, softcap, HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_N, BLOCK_SIZE,
                                         q_ptr.dtype.element_ty, KV_QUANT, UPCAST_DOT, DOT_PRECISION, SOFTCAP)
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + q_tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=io_mask)
        else:
            # This program's share of the block's keys: split `split` of num_used.
            split_keys = tl.maximum(tl.cdiv(tl.cdiv(key_end - key_begin, NUM_SPLITS), SPLIT_KEYS), 1) * SPLIT_KEYS
            num_used = tl.maximum(tl.cdiv(key_end - key_begin, split_keys), 1)
            if split < num_used:
                split_begin = key_begin + split * split_keys
                m_i, l_i, acc = _attend_keys(q, split_begin, tl.minimum(split_begin + split_keys, key_end),
                                             block_table_row, stride_bb, query_pos, oldest_key, k_cache, v_cache,
                                             k_scale, v_scale, kv_head, num_kv_heads, d, d_mask, qk_scale, softcap,
                                             HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_N, BLOCK_SIZE,
                                             q_ptr.dtype.element_ty, KV_QUANT, UPCAST_DOT, DOT_PRECISION, SOFTCAP)
                out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
                dst = out_ptr + q_tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
                if num_used == 1:
                    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=io_mask)
                else:
                    # [T, Hq, S] partials; a row that sees no key of this split stores lse -inf, weight 0.
                    part = (q_tok * (num_kv_heads * GROUP) + head) * NUM_SPLITS
                    tl.store(part_out_ptr + (part + split)[:, None] * HEAD_DIM + d[None, :], out, mask=io_mask)
                    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
                    tl.store(part_lse_ptr + part + split, lse, mask=row_valid)
                    # Every thread's stores precede the (release) arrival; the last arrival (acquire) merges.
                    tl.debug_barrier()
                    arrivals = arrivals_ptr + program * num_kv_heads + kv_head
                    if tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu") == num_used - 1:
                        tl.store(arrivals, 0)  # zero again for the next launch (or graph replay)
                        out = _merge_rows(part_out_ptr, part_lse_ptr, part, num_used, d, row_valid, io_mask,
                                          HEAD_DIM, BLOCK_M, BLOCK_D)
                        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _attend_keys(q, key_begin, key_end, block_table_row, stride_bb, query_pos, oldest_key, k_cache, v_cache, k_scale,
                 v_scale, kv_head, num_kv_heads, d, d_mask, qk_scale, softcap, HEAD_DIM: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 COMPUTE_DTYPE: tl.constexpr, KV_QUANT: tl.constexpr, UPCAST_DOT: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """A query block's online softmax over the keys [key_begin, key_end) that each row may see (causal,
    and its window's): the running max, sum and unnormalized output."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for tile in range(key_begin // BLOCK_N, tl.cdiv(key_end, BLOCK_N)):
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = (pos >= key_begin) & (pos < key_end)
        slot = _slots_of(block_table_row, stride_bb, pos, valid, BLOCK_SIZE)
        key_mask = valid[None, :] & (pos[None, :] <= query_pos[:, None]) & (pos[None, :] >= oldest_key[:, None])
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache, v_cache, k_scale, v_scale, slot, kv_head,
                                     num_kv_heads, HEAD_DIM, valid, key_mask, d, d_mask, qk_scale, softcap,
                                     COMPUTE_DTYPE, KV_QUANT, UPCAST_DOT, DOT_PRECISION, SOFTCAP)
    return m_i, l_i, acc


@triton.jit
def _merge_rows(part_out_ptr, part_lse_ptr, part, num_used, d, row_valid, io_mask, HEAD_DIM: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The prefill splits' partial outputs of BLOCK_M rows (their [T, Hq, S] index `part` at split 0),
    weighted by their log-sum-exps, one split at a time (an online softmax over the splits)."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(num_used):
        # .cg reads L2, where the other programs' stores landed, never a stale L1 line.
        lse = tl.load(part_lse_ptr + part + s, mask=row_valid, other=float("-inf"), cache_modifier=".cg")
        value = tl.load(part_out_ptr + (part + s)[:, None] * HEAD_DIM + d[None, :], mask=io_mask, other=0.0,
                        cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_shift)
        weight = tl.exp2(lse - m_shift)
        acc = acc * alpha[:, None] + value * weight[:, None]
        total = total * alpha + weight
        m = m_new
    return acc / tl.where(total > 0, total, 1.0)[:, None]


def triton_prefill_attention(q: torch.Tensor, cache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                             query_start_loc: torch.Tensor, scale: float, tuning: dict | None = None,
                             first_seq: int | torch.Tensor = 0, out: torch.Tensor | None = None,
                             max_seqs: int | None = None, pdl: bool = False,
                             window: int | None = None, softcap: float | None = None,
                             num_splits: int | None = None) -> torch.Tensor:
    """q: [T, Hq, D], a varlen batch (any mix of prefill chunks and decodes) -> [T, Hq, D].
    window: a sliding window, each query sees only its last `window` keys; softcap: scores s become
    tanh(s / softcap) * softcap.
    num_splits: how many programs at most share a query block's keys, a power of two; None:
    prefill_num_splits (several for launches of few tokens on CUDA, else 1).

    first_seq: the sequences before it have one query each and are someone else's (the decode
    kernel's): only the rest are computed, into `out` (allocated when None). An int32 device scalar
    when the host does not know it (a mixed graph): the grid then covers any value, and max_seqs
    (when given) bounds how many sequences there are from first_seq on, which keeps the grid small:
    every program past the real blocks pays a search over all sequences before it exits."""
    num_tokens, num_q_heads, head_dim = q.shape
    _check_cache(cache)
    num_kv_heads, block_size = cache.k.shape[2], cache.k.shape[1]
    num_seqs = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    tune = _tuning(q, PREFILL_TUNING_FLOAT32 if q.dtype == torch.float32 else PREFILL_TUNING, tuning)
    block_m = max(tune["BLOCK_M"], triton.next_power_of_2(group))
    block_q = block_m // group
    out = torch.empty_like(q) if out is None else out
    quant = _kv_quant(cache)
    in_memory = isinstance(first_seq, torch.Tensor)
    grid_first_seq = 0 if in_memory else first_seq
    num_blocks = (num_tokens - grid_first_seq) // block_q + (max_seqs or num_seqs - grid_first_seq)
    if num_splits is None:
        num_splits = prefill_num_splits(num_blocks * num_kv_heads, block_tables.shape[1] * block_size, q.device,
                                        tune["SPLIT_KEYS"])
    assert num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    part_out = part_lse = arrivals = out  # unused when num_splits == 1
    if num_splits > 1:
        part_out = torch.empty(num_tokens, num_q_heads, num_splits, head_dim, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(num_tokens, num_q_heads, num_splits, device=q.device, dtype=torch.float32)
        arrivals = _arrival_counters(q.device, num_blocks * num_kv_heads)
    _prefill_kernel[(num_blocks, num_kv_heads, num_splits)](
        q, out, part_out, part_lse, arrivals, cache.k, cache.v,
        *_scales(cache),
        block_tables, seq_lens, query_start_loc, scale * LOG2E, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), block_tables.stride(1), first_seq, num_seqs,
        num_kv_heads, window or 0, (softcap or 0.0) * LOG2E, head_dim,
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=tune["BLOCK_N"], BLOCK_SIZE=block_size, SPLIT_KEYS=tune["SPLIT_KEYS"], NUM_SPLITS=num_splits,
        KV_QUANT=quant, UPCAST_DOT=not q.is_cuda,
        DOT_PRECISION=_dot_precision(q.dtype), FIRST_SEQ_IN_MEMORY=in_memory, SOFTCAP=softcap is not None,
        num_warps=tune["num_warps"],
        num_stages=tune["num_stages"], **pdl_launch(pdl),
    )
    return out


# ---------------------------------------------------------------------------------------------


def _kv_quant(cache) -> int:
    return {torch.int8: KV_INT8, torch.float8_e4m3fn: KV_FP8}.get(cache.k.dtype, KV_PLAIN).value


def _scales(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 scale pools, or the value pools as unused stand-ins (kernels take a pointer either way)."""
    if cache.k_scale is None:
        return cache.k, cache.v
    return cache.k_scale, cache.v_scale


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 models get exact dots; tf32 would cost them ~3 decimal digits.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_cache(cache) -> None:
    assert cache.k.is_contiguous() and cache.v.is_contiguous(), "KV pools must be contiguous"
    assert (cache.k_scale is not None) == (cache.k.dtype == torch.int8), "int8 pools need scales"
