"""One Triton GEMV family for decode-sized matmuls y[M, N] = x[M, K] @ W^T, M <= GEMV_MAX_M, with the
weight W [N, K] stored dense (bf16 / fp16 / fp32), as int8 codes with a scale per output channel, or
as our packed int4 codes (byte j of a row: column 2j low nibble, 2j + 1 high) with a float32 scale
and zero per group of GROUP columns (w = q * s + z). The format is a constexpr, so the three share
one kernel body; quant/triton_kernels.py calls it for the quantized layers.

At small M the time is the time to read W, so the kernel is built around streaming it:
- A program owns BLOCK_N rows of W and walks its K slice in [BLOCK_N, BLOCK_K] steps, K contiguous
  in memory and in each thread's registers, so every load is a 16-byte vector (the previous int8
  kernel read a transposed [BLOCK_K, BLOCK_N] tile: one byte per thread per row; a K mask against
  a runtime bound also breaks vectors, so whole steps load unmasked, EVEN_K).
- One row (BLOCK_M = 1) multiplies on the CUDA cores (_row_times_weights). Codes are read as int32
  words and become floats by bit tricks, not int->float conversions, which issue at a quarter of
  the FP32 rate on H100 (16 / clk / SM) while int4 at full bandwidth needs ~26 codes / clk / SM: a
  code shifted into the mantissa of 1.0 reads as 1 + q / 2**b (_lane), and the 1 comes back out
  of the sum through the sum of x. Dense and int8 products accumulate elementwise across steps
  and are reduced across threads once; int4's reduce per group to apply its scale and zero
  (sum x (q s + z) = s sum x q + z sum x).
- Two to sixteen rows pad to one 16-row tensor-core tile (_rows_times_weights): W is the dot's left
  operand (y^T = W x^T), so N, the long side, fills the MMA's 16-row dimension and every row of x
  reuses the weights read once; M = 16 costs about what M = 1 costs. BLOCK_M = 16 at M = 1 is a
  tunable alternative. int4 codes become 16-bit floats by ORing them into the mantissa of a power
  of two (_codes_as), after tl.interleave puts the nibbles back in column order.
- Either way the nibble order is undone in registers, a per-thread permutation: the checkpoint's
  packed layout is read as stored, with no repacked copy of the weights.
- Split-K: when N / BLOCK_N gives too few programs to keep enough loads in flight (o_proj,
  down_proj), K is cut into split_k slices. Each slice writes float32 partials; the last slice of
  a row block to finish (an atomic counter per block) adds all partials in slice order and writes
  y, then zeroes its counter for the next launch. One kernel, deterministic (fixed summation
  order), where float atomics into a zeroed buffer would need a memset and a cast kernel besides
  and sum in arrival order. The cost: M * N * split_k floats written and read back (capped at
  PARTIALS_MAX_SHARE of the weight bytes; ~0.4% at M = 1 for Llama's o_proj), one persistent
  counter buffer per device, and launches of one device must not overlap on two streams.

Launches are CUDA-graph safe: grid, split and buffers follow from shapes alone, nothing syncs with
the host. Configs come from TUNED_CONFIGS (benchmarks/gpu_gemv.py --sweep on an H100, keyed by
format, rows and shape) or else default_config's rule; every field can be overridden per call.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from goodserve.ops.pdl import pdl_launch, pdl_sync
from goodserve.ops.triton_ops import silu_times_up

GEMV_MAX_M = 16  # up to one tensor-core tile of rows
DENSE, INT8, INT4 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
FORMATS = {"dense": DENSE, "int8": INT8, "int4": INT4}
BYTES_PER_WEIGHT = {"dense": 2.0, "int8": 1.0, "int4": 0.5}  # dense: bf16 / fp16 on the GPU
# Split counters: one per row block of a split launch (lm_head has 128256 / 8 blocks at most).
MAX_SPLIT_BLOCKS = 1 << 16
INTERPRETER_SMS = 4  # CPU (TRITON_INTERPRET): small, so that tests exercise the split path


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_m: int  # 1: one row on the CUDA cores; 16: rows padded to a tensor-core tile
    block_n: int  # rows of W per program
    block_k: int  # columns of W per loop step (int4: a multiple of the group size)
    num_warps: int
    num_stages: int  # software pipelining depth of the weight loads
    split_k: int  # K slices (1: none)


# Measured winners, (format, rows, N, K) -> config, rows 1 for M = 1 and 16 for M = 2..16, from
# `benchmarks/gpu_gemv.py --sweep` on an H100 80GB HBM3 (benchmarks/results/gpu_gemv_h100.json; int4
# with group 128): Llama-3.1-8B's shapes. Other shapes use default_config. Dense entries exist only
# where the GEMV won at one row: those shapes are the ones ops/gemv_linear.py routes here (qkv_proj:
# 0.4 us slower than cuBLAS alone, 1 tok/s faster in the engine's decode, where the GEMV launches
# with PDL; benchmarks/results/gpu_engine_routing_h100.json).
# Fields: block_m, block_n, block_k, num_warps, num_stages, split_k. ²: a second, int8-only sweep
# starting from the first one's winners (gpu_gemv_int8_h100.json).
TUNED_CONFIGS: dict[tuple[str, int, int, int], GemvConfig] = {
    ("int8", 1, 6144, 4096): GemvConfig(16, 32, 128, 2, 3, 4),  # qkv_proj 13.12 us, 64% of floor²
    ("int4", 1, 6144, 4096): GemvConfig(1, 64, 128, 4, 1, 9),  # qkv_proj 11.08 us, 43% of floor
    ("int8", 16, 6144, 4096): GemvConfig(16, 32, 128, 2, 2, 7),  # qkv_proj 14.47 us, 58% of floor
    ("int4", 16, 6144, 4096): GemvConfig(16, 32, 128, 2, 3, 4),  # qkv_proj 15.92 us, 30% of floor
    ("dense", 1, 6144, 4096): GemvConfig(1, 16, 128, 4, 1, 3),  # qkv_proj 21.02 us, 80% of floor
    ("int8", 1, 4096, 4096): GemvConfig(16, 32, 128, 2, 3, 6),  # o_proj 10.53 us, 53% of floor²
    ("int4", 1, 4096, 4096): GemvConfig(1, 64, 256, 4, 1, 13),  # o_proj 9.12 us, 34% of floor
    ("dense", 1, 4096, 4096): GemvConfig(1, 8, 256, 8, 1, 2),  # o_proj 15.23 us, 73% of floor
    ("int8", 16, 4096, 4096): GemvConfig(16, 32, 128, 2, 3, 4),  # o_proj 10.87 us, 52% of floor
    ("int4", 16, 4096, 4096): GemvConfig(16, 32, 256, 2, 3, 4),  # o_proj 12.4 us, 25% of floor
    ("int8", 1, 28672, 4096): GemvConfig(1, 8, 512, 4, 1, 1),  # gate_up_proj 44.63 us, 88% of floor
    ("int4", 1, 28672, 4096): GemvConfig(1, 32, 256, 1, 1, 6),  # gate_up_proj 35.39 us, 62% of floor
    ("dense", 1, 28672, 4096): GemvConfig(1, 8, 512, 4, 1, 1),  # gate_up_proj 78.21 us, 100% of floor
    ("int8", 16, 28672, 4096): GemvConfig(16, 32, 256, 2, 4, 1),  # gate_up_proj 45.74 us, 86% of floor
    ("int4", 16, 28672, 4096): GemvConfig(16, 64, 128, 4, 3, 2),  # gate_up_proj 47.5 us, 46% of floor
    ("int8", 1, 4096, 14336): GemvConfig(16, 32, 128, 2, 3, 6),  # down_proj 25.32 us, 77% of floor²
    ("int4", 1, 4096, 14336): GemvConfig(1, 64, 256, 2, 1, 13),  # down_proj 20.15 us, 55% of floor
    ("dense", 1, 4096, 14336): GemvConfig(1, 8, 256, 8, 1, 2),  # down_proj 42.94 us, 91% of floor
    ("int8", 16, 4096, 14336): GemvConfig(16, 32, 128, 2, 3, 6),  # down_proj 26.51 us, 74% of floor
    ("int4", 16, 4096, 14336): GemvConfig(16, 32, 128, 2, 3, 8),  # down_proj 29.35 us, 38% of floor
    ("int8", 1, 128256, 4096): GemvConfig(1, 8, 512, 4, 1, 1),  # lm_head 185.07 us, 95% of floor
    ("int4", 1, 128256, 4096): GemvConfig(1, 64, 256, 2, 1, 2),  # lm_head 130.22 us, 76% of floor
    ("dense", 1, 128256, 4096): GemvConfig(1, 8, 512, 8, 1, 1),  # lm_head 336.54 us, 104% of floor
    ("int8", 16, 128256, 4096): GemvConfig(16, 32, 256, 2, 3, 1),  # lm_head 180.61 us, 97% of floor
    ("int4", 16, 128256, 4096): GemvConfig(16, 64, 128, 4, 3, 1),  # lm_head 176.23 us, 56% of floor
    # One rank's shards at TP=2 (gpu_gemv.py --tensor-parallel 2 --sweep, 2 x H200; cuBLAS in brackets)
    ("dense", 1, 3072, 4096): GemvConfig(1, 16, 256, 4, 1, 5),  # TP=2 qkv_proj 8.96 us (11.0)
    ("dense", 1, 4096, 2048): GemvConfig(1, 8, 256, 8, 1, 1),  # TP=2 o_proj 7.25 us (7.2)
    ("dense", 1, 14336, 4096): GemvConfig(1, 8, 512, 1, 1, 1),  # TP=2 gate_up_proj 30.11 us (30.6)
    ("dense", 1, 4096, 7168): GemvConfig(1, 8, 256, 8, 1, 2),  # TP=2 down_proj 17.37 us (18.9)
    ("dense", 1, 64128, 4096): GemvConfig(1, 32, 256, 4, 1, 1),  # TP=2 lm_head 120.46 us (130.3)
    # Qwen3-30B-A3B's attention and lm_head (gpu_gemv.py --model qwen3-30b-a3b --sweep, H100,
    # gpu_gemv_sweep_qwen3_30b_a3b_5dc54a3_h100.json; cuBLAS in brackets, its kernels' times in that model's
    # decode step, gpu_profile_b1_qwen3_30b_a3b_5dc54a3_h100.txt: o_proj's with its split-K reduce)
    ("dense", 1, 5120, 2048): GemvConfig(1, 8, 256, 4, 1, 1),  # qkv_proj 9.22 us (9.47)
    ("dense", 1, 2048, 4096): GemvConfig(1, 8, 256, 4, 1, 4),  # o_proj 8.91 us (8.30 + 1.70)
    ("dense", 1, 151936, 2048): GemvConfig(1, 16, 512, 4, 1, 1),  # lm_head 195.54 us (202.61)
    # Qwen3-8B's MLP and lm_head (gpu_gemv.py --model qwen3-8b --sweep, H100, gpu_gemv_sweep_qwen3_8b_f0f9bad_h100.json;
    # its qkv_proj and o_proj have Llama-3.1-8B's shapes; cuBLAS in brackets)
    ("dense", 1, 24576, 4096): GemvConfig(1, 16, 512, 8, 1, 1),  # gate_up_proj 65.18 us (67.8)
    ("dense", 1, 4096, 12288): GemvConfig(1, 8, 256, 8, 1, 2),  # down_proj 36.41 us (37.4)
    ("dense", 1, 151936, 4096): GemvConfig(1, 8, 512, 4, 1, 1),  # lm_head 387.8 us (415.2)
}

# default_config's tiles: (format, block_m) -> (block_n, block_k, num_warps, num_stages, programs
# resident per SM). Picked offline from sm_90 SASS (Triton 3.9): the fewest instructions per weight
# byte among tiles that keep 24-64 KB of loads in flight per SM at the occupancy their registers
# and shared memory allow (the last field). Triton pipelines only loads that feed a dot, so the
# CUDA-core path (block_m 1) hides latency by occupancy alone (num_stages does nothing there);
# the tensor-core path streams through shared memory. Its 2-warp tiles keep Triton on mma.sync,
# which reads quantized operands from shared memory in wider pieces than its 4-warp wgmma path.
DEFAULT_TILES = {
    ("dense", 1): (16, 256, 4, 1, 7),
    ("int8", 1): (16, 512, 4, 1, 4),
    ("int4", 1): (32, 256, 2, 1, 6),
    ("dense", 16): (64, 64, 2, 3, 11),
    ("int8", 16): (64, 128, 2, 3, 9),
    ("int4", 16): (128, 128, 2, 3, 5),
}
# Split K until the grid fills the resident programs of every SM, keeping the split's float32
# partials (M x N x 4 bytes per slice, written and read back) under this share of the weight bytes.
PARTIALS_MAX_SHARE = 1 / 8


@triton.jit
def _lane(words, LANE: tl.constexpr, BITS: tl.constexpr, FLIP: tl.constexpr):
    """Code LANE of each int32 word (bits BITS * LANE up), XOR FLIP, as the float32 1 + code / 2**BITS:
    the code shifted to the top of the mantissa of 1.0. A shift and a mask-or per code, no
    conversion instruction, and the result feeds an FMA; callers take the 1 back out of the sum."""
    code = ((words >> (BITS * LANE)) & ((1 << BITS) - 1)) ^ FLIP
    return ((code << (23 - BITS)) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _word_codes(words, BITS: tl.constexpr, FLIP: tl.constexpr):
    """int32 words [..., W] -> their 32 // BITS codes each as [..., W, 2, 2(, 2)] floats (_lane), in
    memory order (little endian: lane i is the next column), which reshapes to [..., W * 32 // BITS].
    The joins only rename registers: each thread holds whole words."""
    if BITS == 8:
        return tl.join(tl.join(_lane(words, 0, 8, FLIP), _lane(words, 2, 8, FLIP)),
                       tl.join(_lane(words, 1, 8, FLIP), _lane(words, 3, 8, FLIP)))
    else:
        evens = tl.join(tl.join(_lane(words, 0, 4, FLIP), _lane(words, 4, 4, FLIP)),
                        tl.join(_lane(words, 2, 4, FLIP), _lane(words, 6, 4, FLIP)))
        odds = tl.join(tl.join(_lane(words, 1, 4, FLIP), _lane(words, 5, 4, FLIP)),
                       tl.join(_lane(words, 3, 4, FLIP), _lane(words, 7, 4, FLIP)))
        return tl.join(evens, odds)


@triton.jit
def _codes_as(u, DTYPE: tl.constexpr, OFFSET: tl.constexpr):
    """Integer codes 0 <= u < 256 (< 128 for bfloat16) -> u - OFFSET in DTYPE, exactly: the code ORed
    into the low mantissa bits of a power of two B reads as B + u, then one subtraction."""
    if DTYPE == tl.float32:
        return (u.to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)
    elif DTYPE == tl.float16:
        return (u.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + OFFSET)
    else:
        return (u.to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True) - (128.0 + OFFSET)


@triton.jit
def _before(offs, stop, EVEN_K: tl.constexpr):
    """The K mask; none (all true, folded away) when every step is whole, so that the loads stay
    16-byte vectors: a mask against a runtime bound makes Triton load element by element."""
    if EVEN_K:
        return tl.full(offs.shape, 1, tl.int1)
    else:
        return offs < stop


@triton.jit
def _load_x(x_ptr, offs, mask, up_offset, GLU: tl.constexpr):
    """x at offs as float32. GLU: x is SwiGLU's silu(gate) * up of a [gate | up] row (up at up_offset),
    rounded where ops/triton_ops' silu_and_mul kernel rounds it, so a GEMV can take the gate_up
    projection's output as it is and the activation kernel drops out."""
    if GLU:
        gate = tl.load(x_ptr + offs, mask=mask, other=0.0)
        up = tl.load(x_ptr + up_offset + offs, mask=mask, other=0.0)
        return silu_times_up(gate, up, x_ptr.dtype.element_ty).to(x_ptr.dtype.element_ty).to(tl.float32)
    else:
        return tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _row_times_weights(x_ptr, w_ptr, s_ptr, z_ptr, offs_n, n_mask, k_start, k_stop, stride_wn, stride_sn,
                       FORMAT: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                       up_offset=0, GLU: tl.constexpr = False):
    """One row on the CUDA cores: [BLOCK_N] float32 sums of x[k] W[n, k] over [k_start, k_stop)
    (GLU: x is _load_x's SwiGLU of a [gate | up] row whose up half starts up_offset on).

    Dense and int8 products accumulate elementwise across steps and are reduced across threads
    once, at the end; int4's reduce per group to apply its scale. Codes are read as int32 words
    and enter as 1 + q / 2**b (_lane): sum x (1 + q / 2**b) = sum x + sum x q / 2**b, so sum x q
    comes back with the sum of x, which every row shares.
    """
    if FORMAT == INT4:
        groups = tl.arange(0, BLOCK_K // GROUP)  # a step is [BLOCK_N, BLOCK_K // GROUP, GROUP] codes
        cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        word_cols = groups[:, None] * (GROUP // 8) + tl.arange(0, GROUP // 8)[None, :]
        w_ptrs = w_ptr.to(tl.pointer_type(tl.int32)) + offs_n[:, None, None] * (stride_wn // 4) + word_cols[None]
        acc = tl.zeros((offs_n.shape[0], BLOCK_K // GROUP), dtype=tl.float32)
        for k_step in range(k_start, k_stop, BLOCK_K):
            x = _load_x(x_ptr, k_step + cols[None], _before(k_step + cols, k_stop, EVEN_K)[None], up_offset, GLU)
            w_mask = n_mask[:, None, None] & _before(k_step // 8 + word_cols, k_stop // 8, EVEN_K)[None]
            words = tl.load(w_ptrs + k_step // 8, mask=w_mask, other=0)
            codes = tl.reshape(_word_codes(words, 4, 0), (offs_n.shape[0], BLOCK_K // GROUP, GROUP))
            # A group past the slice's end has x = 0 and adds 0; clamping keeps its index in bounds.
            group = tl.minimum(k_step + groups * GROUP, k_stop - 1)[None, :] // GROUP
            scale = 16.0 * tl.load(s_ptr + offs_n[:, None] * stride_sn + group, mask=n_mask[:, None], other=0.0)
            zero = tl.load(z_ptr + offs_n[:, None] * stride_sn + group, mask=n_mask[:, None], other=0.0)
            x_sum = tl.sum(x, axis=2)
            acc += scale * tl.sum(codes * x, axis=2) + (zero - scale) * x_sum  # q = 16 (code - 1)
        return tl.sum(acc, axis=1)
    else:
        cols = tl.arange(0, BLOCK_K)[None, :]
        acc = tl.zeros((offs_n.shape[0], BLOCK_K), dtype=tl.float32)
        x_acc = tl.zeros((1, BLOCK_K), dtype=tl.float32)
        for k_step in range(k_start, k_stop, BLOCK_K):
            k_mask = _before(k_step + cols, k_stop, EVEN_K)
            x = _load_x(x_ptr, k_step + cols, k_mask, up_offset, GLU)
            if FORMAT == INT8:  # codes q + 128 = 0..255 as 1 + (q + 128) / 256
                word_cols = k_step // 4 + tl.arange(0, BLOCK_K // 4)[None, :]
                words = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + offs_n[:, None] * (stride_wn // 4) + word_cols,
                                mask=n_mask[:, None] & _before(word_cols, k_stop // 4, EVEN_K), other=0)
                acc += tl.reshape(_word_codes(words, 8, 0x80), (offs_n.shape[0], BLOCK_K)) * x
                x_acc += x
            else:
                w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k_step + cols, mask=n_mask[:, None] & k_mask,
                            other=0)
                acc += w.to(tl.float32) * x
        if FORMAT == INT8:  # sum x q = 256 (sum x code - 1.5 sum x)
            return 256.0 * tl.sum(acc, axis=1) - 384.0 * tl.sum(x_acc, axis=1)
        else:
            return tl.sum(acc, axis=1)


@triton.jit
def _rows_times_weights(x_ptr, w_ptr, s_ptr, z_ptr, offs_n, n_mask, M, k_start, k_stop, stride_xm, stride_wn,
                        stride_sn, FORMAT: tl.constexpr, GROUP: tl.constexpr, TILE_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                        DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Up to BLOCK_M rows on the tensor cores: [BLOCK_N, BLOCK_M] float32, acc[n, m] = sum x[m, k] W[n, k].

    W is the dot's left operand (acc = W x^T). A step of BLOCK_K columns is BLOCK_K // TILE_K tiles:
    one for dense and int8, one per group for int4 (its scale and zero are per group).
    """
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    acc = tl.zeros((offs_n.shape[0], BLOCK_M), dtype=tl.float32)
    for k_step in range(k_start, k_stop, BLOCK_K):
        for t in tl.static_range(BLOCK_K // TILE_K):
            k0 = k_step + t * TILE_K
            offs_k = k0 + tl.arange(0, TILE_K)
            k_mask = _before(offs_k, k_stop, EVEN_K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            x_t = tl.trans(x.to(DOT_DTYPE))
            if FORMAT == INT4:
                offs_b = k0 // 2 + tl.arange(0, TILE_K // 2)  # the group's bytes
                packed = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_b[None, :],
                                 mask=n_mask[:, None] & _before(offs_b, k_stop // 2, EVEN_K)[None, :], other=0)
                codes = _codes_as(tl.interleave(packed & 0xF, packed >> 4), DOT_DTYPE, 0)  # column order
                group = tl.minimum(k0, k_stop - 1) // GROUP  # see _row_times_weights
                scale = tl.load(s_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0)
                zero = tl.load(z_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0)
                x_sum = tl.sum(x.to(tl.float32), axis=1)
                products = tl.dot(codes, x_t, input_precision=DOT_PRECISION)
                acc += products * scale[:, None] + zero[:, None] * x_sum[None, :]
            else:
                w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                            mask=n_mask[:, None] & k_mask[None, :], other=0)
                if FORMAT == INT8 and DOT_DTYPE != tl.bfloat16:  # q + 128 needs 8 mantissa bits
                    w = _codes_as(w.to(tl.uint8, bitcast=True) ^ 0x80, DOT_DTYPE, 128)
                acc = tl.dot(w.to(DOT_DTYPE), x_t, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, part_ptr, count_ptr,
                 M, N, K, stride_xm, stride_wn, stride_sn, stride_ym, steps_per_split,
                 FORMAT: tl.constexpr, GROUP: tl.constexpr, TILE_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 SPLIT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """Program (row block, K slice) -> y[:, row block] (or its slice's partial); see the module doc.

    Slices are whole BLOCK_K steps (k_start a multiple of BLOCK_K, which also tells the compiler
    the loads are 16-byte aligned).
    """
    pid_n, split = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask, m_mask = offs_n < N, offs_m < M
    k_start = split * steps_per_split * BLOCK_K
    k_stop = tl.minimum(k_start + steps_per_split * BLOCK_K, K)
    pdl_sync(USE_PDL)
    if BLOCK_M == 1:
        acc = _row_times_weights(x_ptr, w_ptr, s_ptr, z_ptr, offs_n, n_mask, k_start, k_stop, stride_wn,
                                 stride_sn, FORMAT, GROUP, BLOCK_K, EVEN_K)[:, None]
    else:
        acc = _rows_times_weights(x_ptr, w_ptr, s_ptr, z_ptr, offs_n, n_mask, M, k_start, k_stop, stride_xm,
                                  stride_wn, stride_sn, FORMAT, GROUP, TILE_K, BLOCK_M, BLOCK_K, EVEN_K,
                                  DOT_DTYPE, DOT_PRECISION)
    if FORMAT == INT8:
        acc *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
    out_mask = n_mask[:, None] & m_mask[None, :]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    if SPLIT:
        _finish_split(acc, part_ptr, count_ptr, y_ptrs, offs_n, offs_m, out_mask, M, N, pid_n, split)
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _finish_split(acc, part_ptr, count_ptr, y_ptrs, offs_n, offs_m, out_mask, M, N, pid_n, split):
    """Store this slice's partial; the last slice of a row block to arrive sums all of them in
    slice order (deterministic) into y and resets the block's counter."""
    part_offs = offs_m[None, :] * N + offs_n[:, None]
    if _arrived_last(acc, part_ptr, count_ptr, part_offs, out_mask, M, N, pid_n, split):
        total = _sum_partials(acc, part_ptr, part_offs, out_mask, M, N)
        tl.store(y_ptrs, total.to(y_ptrs.dtype.element_ty), mask=out_mask)
        tl.atomic_xchg(count_ptr + pid_n, 0)


@triton.jit
def _arrived_last(acc, part_ptr, count_ptr, part_offs, out_mask, M, N, pid_n, split):
    """_finish_split's first half: store this slice's partial; whether it was the row block's last."""
    tl.store(part_ptr + split * M * N + part_offs, acc, mask=out_mask)
    tl.debug_barrier()  # every thread's partial is written before the counter says so
    arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    return arrived == tl.num_programs(1) - 1


@triton.jit
def _sum_partials(acc, part_ptr, part_offs, out_mask, M, N):
    """The row block's partials summed in slice order (the last slice to arrive calls it)."""
    total = tl.zeros(acc.shape, dtype=tl.float32)
    for s in range(0, tl.num_programs(1)):  # .cg: read the other SMs' partials from L2, not a stale L1
        total += tl.load(part_ptr + s * M * N + part_offs, mask=out_mask, other=0.0, cache_modifier=".cg")
    return total


# ---------------------------------------------------------------------------------------------
# Configs


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def rows_bucket(m: int) -> int:
    """TUNED_CONFIGS' row key: 1 for M = 1, 16 for 2..16 (one padded tensor-core tile)."""
    return 1 if m == 1 else GEMV_MAX_M


def default_config(fmt: str, m: int, n: int, k: int, group: int, sms: int, **tile) -> GemvConfig:
    """DEFAULT_TILES for the path M takes (or tile["block_m"]), with any of block_n / block_k /
    num_warps / num_stages given in tile; block_k is cut to K's size (but to no less than an int4
    group); split_k follows from the tile and the shape unless given."""
    block_m = tile.get("block_m") or rows_bucket(m)
    block_n, block_k, num_warps, num_stages, resident = DEFAULT_TILES[fmt, block_m]
    block_n = tile.get("block_n") or block_n
    block_k = tile.get("block_k") or max(16, group, min(block_k, triton.next_power_of_2(k)))
    wanted = triton.cdiv(resident * sms, triton.cdiv(n, block_n))
    affordable = int(PARTIALS_MAX_SHARE * k * BYTES_PER_WEIGHT[fmt] / (4 * max(m, 1)))
    split_k = tile.get("split_k") or max(1, min(wanted, affordable, triton.cdiv(k, block_k)))
    return GemvConfig(block_m, block_n, block_k, tile.get("num_warps") or num_warps,
                      tile.get("num_stages") or num_stages, split_k)


def gemv_config(fmt: str, m: int, n: int, k: int, group: int, device: torch.device, **overrides) -> GemvConfig:
    """TUNED_CONFIGS on CUDA where the shape is listed and no override is given, else
    default_config with the overrides (block_m / block_n / block_k / num_warps / num_stages /
    split_k; None: the default)."""
    overrides = {key: value for key, value in overrides.items() if value is not None}
    tuned = TUNED_CONFIGS.get((fmt, rows_bucket(m), n, k)) if device.type == "cuda" else None
    if tuned is not None and not overrides and tuned.block_k % max(group, 1) == 0:
        config = tuned
    else:
        config = default_config(fmt, m, n, k, group, num_sms(device), **overrides)
    _check_config(config, fmt, m, group)
    return config


def _check_config(config: GemvConfig, fmt: str, m: int, group: int) -> None:
    c = config
    powers = (c.block_n, c.block_k, c.num_warps)
    if any(v < 1 or v & (v - 1) for v in powers):
        raise ValueError(f"block_n, block_k and num_warps must be powers of two: {c}")
    if c.block_m not in (1, 16) or m > c.block_m:
        raise ValueError(f"block_m must be 1 (M = 1) or 16 (M <= 16); got {c.block_m} for M = {m}")
    if (c.block_m == 16 and c.block_n < 16) or c.block_k < 16:
        raise ValueError(f"tensor-core tiles need block_n >= 16 and block_k >= 16: {c}")
    if fmt == "int4" and c.block_k % group:
        raise ValueError(f"int4 block_k must be a multiple of the group size {group}: {c}")
    if c.split_k < 1 or c.num_stages < 1:
        raise ValueError(f"split_k and num_stages must be at least 1: {c}")


def split_plan(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(slices, BLOCK_K steps per slice): whole steps, so only the last slice is ragged; asking for
    more slices than steps gives one step each."""
    steps = triton.cdiv(k, block_k)
    per_split = triton.cdiv(steps, min(split_k, steps))
    return triton.cdiv(steps, per_split), per_split


@functools.lru_cache(maxsize=None)
def split_counters(device: torch.device) -> torch.Tensor:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the split-K GEMV allocates its counters on first use: call it once before "
                           "capturing a CUDA graph")
    return torch.zeros(MAX_SPLIT_BLOCKS, dtype=torch.int32, device=device)


def _dot_types(x: torch.Tensor) -> tuple[tl.dtype, str]:
    # The interpreter multiplies 16-bit dot operands as raw bit patterns: float32 on CPU tensors.
    # float32 activations get exact products ("ieee"), as the CPU reference computes them.
    if not x.is_cuda or x.dtype == torch.float32:
        return tl.float32, "ieee"
    return (tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16), "tf32"


# ---------------------------------------------------------------------------------------------
# Launch


def gemv(x: torch.Tensor, weight: torch.Tensor, fmt: str, scales: torch.Tensor | None = None,
         zeros: torch.Tensor | None = None, group: int = 0, pdl: bool = False, **overrides) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_M) times the weight of format fmt -> [M, N] in x's dtype.

    dense: weight [N, K]; int8: weight [N, K] int8, scales [N] float32; int4: weight [N, K // 2]
    uint8, scales and zeros [N, K // group] float32. pdl: launch with PDL (ops/pdl.py).
    overrides: GemvConfig fields.
    """
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    assert m <= GEMV_MAX_M and weight.stride(-1) == 1, "GEMV: at most 16 rows and a K-contiguous weight"
    if fmt != "dense":  # the one-row path reads codes as int32 words
        assert k % 4 == 0 and weight.stride(0) % 4 == 0 and weight.data_ptr() % 4 == 0, \
            "quantized GEMV: K a multiple of 4 and 4-byte aligned weight rows"
    config = gemv_config(fmt, m, n, k, group, x.device, **overrides)
    splits, steps_per_split = split_plan(k, config.block_k, config.split_k)
    n_blocks = triton.cdiv(n, config.block_n)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    partials = counters = y  # unused without a split
    if splits > 1:
        assert n_blocks <= MAX_SPLIT_BLOCKS, f"{n_blocks} row blocks: raise MAX_SPLIT_BLOCKS or block_n"
        partials = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device)
    scales = weight if scales is None else scales  # unused for dense
    zeros = scales if zeros is None else zeros  # unused unless int4
    dot_dtype, dot_precision = _dot_types(x)
    _gemv_kernel[(n_blocks, splits)](
        x, weight, scales, zeros, y, partials, counters, m, n, k, x.stride(0), weight.stride(0),
        scales.stride(0), y.stride(0), steps_per_split,
        FORMAT=FORMATS[fmt], GROUP=max(group, 1), TILE_K=group if fmt == "int4" else config.block_k,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0, SPLIT=splits > 1, DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(pdl))
    return y


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, pdl: bool = False, **overrides) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T for M <= 16: the GEMV without dequantization."""
    return gemv(x, weight, "dense", pdl=pdl, **overrides)


# ---------------------------------------------------------------------------------------------
# int4, one row: a thread per weight row
#
# The family's one-row int4 path spreads a row's group over several threads, so every group ends
# in a cross-thread reduction (shuffles) before its scale applies. This variant gives each thread
# whole rows: a step is one group, read as GROUP // 32 chunks of 16 bytes per row (one vector load
# each), decoded with _word_codes and summed in the thread; x's group is read once per thread
# (the same addresses across the warp: broadcasts) and shared by the thread's rows. Two layouts:
# - the checkpoint's codes and float32 scales / zeros as stored: a warp's load touches 32 rows,
#   16 bytes each (the next chunk's load takes the rest of each 32-byte sector);
# - repacked once at load (Int4RowsWeight): codes ordered (row block, group, chunk, row), so a
#   program's slice is one contiguous stream and a warp's load is 512 contiguous bytes; scale and
#   zero as a bfloat16 pair in one int32 word per (row, group), 4 bytes instead of 8. As tinygemm
#   does, the zero stored is the group's midpoint z + 8 s, near 0 where z is near -8 s, so its
#   rounding costs far less than z's would.
# - paired (Int4RowsWeight.paired): the repacked rows interleaved as 0, N/2, 1, N/2 + 1, ..., so
#   that a program holds row j and row N/2 + j side by side. For gate_up_proj ([gate | up] rows)
#   the kernel can then finish SwiGLU itself (gated: y[j] = silu(gate j) * up j, rounded as
#   ops/triton_ops' silu_and_mul kernel rounds it) and the activation kernel drops out of the
#   decode step; a plain call stores each row back at its own index.
# Split-K is by whole groups, with the family's deterministic finish (_finish_split).
# Two decodes (Int4RowsConfig.denormal): the family's _lane (1 + q / 16: a shift and a mask-or a
# code, the OR's constant rematerialized under register pressure), or a code masked in place into
# an fp32 with exponent 0, a subnormal q * 2**(b - 149) for its bit position b: five of a word's
# eight codes need only the AND, the other three share one shift. x is scaled per position by
# 2**(89 - b) once per chunk, so every product is x q 2**-60, a normal number (|x| up to 2**39);
# FMAs keep subnormal inputs (no flush to zero in Triton's fp32 arithmetic).
# Every thread needs all of x's group, so every thread converts x's bfloat16 to float32 and scales it
# (~1.3 of the subnormal decode's 3.9 instructions a code in the sm_90 SASS, at 2 rows a thread).
# Doing that once per block through a float32 scratch instead was slower end to end (138 registers
# a thread, 3 blocks an SM instead of 4: benchmarks/BENCHMARKS.md), so every thread still does it.


@dataclasses.dataclass(frozen=True)
class Int4RowsConfig:
    block_n: int  # rows per program: num_warps * 32 * rows per thread
    num_warps: int
    split_k: int  # K slices of whole groups (1: none)
    denormal: bool = False  # the subnormal decode (see above)


# (N, K) -> config: the repacked layout's fastest at Llama-3.1-8B's shapes, group 128, from
# benchmarks/gpu_int4.py on an H100 80GB HBM3 (benchmarks/results/gpu_int4_h100.json). Both layouts
# read it; the checkpoint layout's own winners differ, and were slower than these at every shape.
INT4_ROWS_TUNED: dict[tuple[int, int], Int4RowsConfig] = {
    (6144, 4096): Int4RowsConfig(256, 4, 22, True),  # qkv_proj 10.88 us (tinygemm 9.64)
    (4096, 4096): Int4RowsConfig(256, 4, 32, True),  # o_proj 8.64 us (tinygemm 6.90)
    (28672, 4096): Int4RowsConfig(256, 4, 5, True),  # gate_up_proj 30.51 us (tinygemm 33.21)
    (4096, 14336): Int4RowsConfig(128, 2, 34, True),  # down_proj 18.63 us (tinygemm 18.26)
    (128256, 4096): Int4RowsConfig(128, 2, 1, True),  # lm_head 112.34 us (tinygemm 134.56, int8 185.2)
}
# block_n, num_warps, programs resident per SM (an estimate for the split rule: ~128 registers a
# thread at two rows a thread).
INT4_ROWS_DEFAULT = (256, 4, 4)


@dataclasses.dataclass(frozen=True)
class Int4RowsWeight:
    """int4 codes repacked for _int4_rows_kernel (see above); rows padded to whole blocks."""

    codes: torch.Tensor  # uint8 [N_pad / block_n, groups, group // 32, block_n, 16]
    scale_zero: torch.Tensor  # int32 [N_pad / block_n, groups, block_n]: bf16 s (low half), bf16 z + 8 s (high)
    n: int
    k: int
    group: int
    block_n: int
    paired: bool = False  # rows j and N/2 + j adjacent (see above)


def _bf16_pair(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Two float tensors rounded to bfloat16 and packed into int32 words (low in bits 0-15)."""
    bits = [t.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF for t in (low, high)]
    word = (bits[1] << 16) | bits[0]
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)  # two's complement


def int4_rows_layout(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                     block_n: int, paired: bool = False) -> Int4RowsWeight:
    """Our packed codes [N, K // 2] and float32 scales / zeros [N, K // group] -> Int4RowsWeight;
    paired: rows j and N/2 + j next to each other (N even)."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    assert group % 32 == 0 and k % group == 0, "int4 rows kernel: groups of a multiple of 32 columns"
    if paired:
        assert n % 2 == 0 and block_n % 2 == 0, "a paired layout needs an even number of rows and block_n"
        order = torch.arange(n, device=qweight.device).view(2, n // 2).T.reshape(-1)  # 0, N/2, 1, N/2 + 1, ...
        qweight, scales, zeros = qweight[order], scales[order], zeros[order]
    blocks, groups = triton.cdiv(n, block_n), k // group
    pad = blocks * block_n - n
    codes = torch.nn.functional.pad(qweight, (0, 0, 0, pad))
    codes = codes.view(blocks, block_n, groups, group // 32, 16).permute(0, 2, 3, 1, 4).contiguous()
    words = _bf16_pair(scales, zeros + 8 * scales)
    words = torch.nn.functional.pad(words, (0, 0, 0, pad)).view(blocks, block_n, groups).transpose(1, 2).contiguous()
    return Int4RowsWeight(codes, words, n, k, group, block_n, paired)


@triton.jit
def _subnormal_bits(cols):
    """Bit position b of column `cols`' nibble once _subnormal_codes has it (0-16; see above)."""
    lane = cols % 8
    return tl.where(lane < 5, 4 * lane, 4 * lane - 12)


@triton.jit
def _position_scales(cols):
    """2**(89 - b) for each column's nibble position b, built from its exponent bits (exact)."""
    return ((216 - _subnormal_bits(cols)) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _sub(words, LANE: tl.constexpr):
    if LANE < 5:  # the nibble stays at bits 4 LANE
        return (words & (0xF << (4 * LANE))).to(tl.float32, bitcast=True)
    else:  # lanes 5-7 from words >> 12, at bits 8-19 (the mask clears the sign's copies)
        return ((words >> 12) & (0xF << (4 * LANE - 12))).to(tl.float32, bitcast=True)


@triton.jit
def _subnormal_codes(words):
    """int32 words [..., W] -> [..., W, 2, 2, 2] subnormal floats q * 2**(b - 149), in memory order
    like _word_codes."""
    evens = tl.join(tl.join(_sub(words, 0), _sub(words, 4)), tl.join(_sub(words, 2), _sub(words, 6)))
    odds = tl.join(tl.join(_sub(words, 1), _sub(words, 5)), tl.join(_sub(words, 3), _sub(words, 7)))
    return tl.join(evens, odds)


@triton.jit
def _int4_rows_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, part_ptr, count_ptr, N, K, stride_ww, stride_sn,
                      groups_per_split, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, REPACKED: tl.constexpr,
                      DENORMAL: tl.constexpr, SPLIT: tl.constexpr, PAIRED: tl.constexpr, GATED: tl.constexpr,
                      USE_PDL: tl.constexpr):
    """Program (row block, K slice of whole groups) -> y[0, row block] (or its slice's partial; the
    last slice stores the block). stride_ww: the checkpoint layout's row stride in int32 words.
    PAIRED: the weight's rows are paired (see above); GATED: then y is [1, N / 2], silu(gate) * up."""
    CHUNKS: tl.constexpr = GROUP // 32  # 16-byte pieces of a row's group
    pid_n, split = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_N)
    offs_n = pid_n * BLOCK_N + rows
    n_mask = offs_n < N
    groups = K // GROUP
    g_start = split * groups_per_split
    g_stop = tl.minimum(g_start + groups_per_split, groups)
    words = w_ptr.to(tl.pointer_type(tl.int32))
    lanes = tl.arange(0, 4)[None, :]
    if REPACKED:
        chunk_ptrs = words + pid_n * (groups * CHUNKS * BLOCK_N * 4) + rows[:, None] * 4 + lanes
    else:
        chunk_ptrs = words + offs_n[:, None] * stride_ww + lanes
    cols = tl.arange(0, 32)
    x_scale = _position_scales(cols)[None, :]
    pdl_sync(USE_PDL)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for g in range(g_start, g_stop):
        dots = tl.zeros((BLOCK_N, 32), dtype=tl.float32)
        x_acc = tl.zeros((1, 32), dtype=tl.float32)
        for c in tl.static_range(CHUNKS):
            x = tl.load(x_ptr + g * GROUP + c * 32 + cols).to(tl.float32)[None, :]
            if REPACKED:
                packed = tl.load(chunk_ptrs + (g * CHUNKS + c) * (BLOCK_N * 4))
            else:
                packed = tl.load(chunk_ptrs + g * (GROUP // 8) + c * 4, mask=n_mask[:, None], other=0)
            if DENORMAL:
                dots += tl.reshape(_subnormal_codes(packed), (BLOCK_N, 32)) * (x * x_scale)  # x q 2**-60
            else:
                dots += tl.reshape(_word_codes(packed, 4, 0), (BLOCK_N, 32)) * x  # codes as 1 + q / 16
            x_acc += x
        if REPACKED:
            sz = tl.load(s_ptr.to(tl.pointer_type(tl.int32)) + (pid_n * groups + g) * BLOCK_N + rows)
            scale = (sz << 16).to(tl.float32, bitcast=True)
            zero = (sz & -65536).to(tl.float32, bitcast=True) - 8.0 * scale  # z = (z + 8 s) - 8 s
        else:
            scale = tl.load(s_ptr + offs_n * stride_sn + g, mask=n_mask, other=0.0)
            zero = tl.load(z_ptr + offs_n * stride_sn + g, mask=n_mask, other=0.0)
        if DENORMAL:  # sum x q = 2**60 sum dots
            acc += (scale * 1.152921504606846976e18) * tl.sum(dots, axis=1) + zero * tl.sum(x_acc, axis=1)
        else:  # q = 16 (code - 1)
            acc += (16.0 * scale) * tl.sum(dots, axis=1) + (zero - 16.0 * scale) * tl.sum(x_acc, axis=1)
    if SPLIT:
        part_offs = offs_n[:, None]
        if _arrived_last(acc[:, None], part_ptr, count_ptr, part_offs, n_mask[:, None], 1, N, pid_n, split):
            total = tl.sum(_sum_partials(acc[:, None], part_ptr, part_offs, n_mask[:, None], 1, N), axis=1)
            _store_rows(total, y_ptr, pid_n, offs_n, n_mask, N, BLOCK_N, PAIRED, GATED)
            tl.atomic_xchg(count_ptr + pid_n, 0)
    else:
        _store_rows(acc, y_ptr, pid_n, offs_n, n_mask, N, BLOCK_N, PAIRED, GATED)


@triton.jit
def _store_rows(acc, y_ptr, pid_n, offs_n, n_mask, N, BLOCK_N: tl.constexpr, PAIRED: tl.constexpr,
                GATED: tl.constexpr):
    """A row block's sums [BLOCK_N] into y: at their rows, at the rows a paired layout took them
    from, or (GATED) as silu(gate) * up of each adjacent pair."""
    dtype = y_ptr.dtype.element_ty
    if GATED:
        gate, up = tl.split(tl.reshape(acc, (BLOCK_N // 2, 2)))
        # Rounded as the unfused path rounds them: the projection's output, then silu(gate), then the product.
        out = silu_times_up(gate.to(dtype), up.to(dtype), dtype)
        offs_j = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + offs_j, out.to(dtype), mask=offs_j < N // 2)
    elif PAIRED:
        tl.store(y_ptr + (offs_n % 2) * (N // 2) + offs_n // 2, acc.to(dtype), mask=n_mask)
    else:
        tl.store(y_ptr + offs_n, acc.to(dtype), mask=n_mask)


def int4_rows_config(n: int, k: int, group: int, device: torch.device, block_n: int | None = None,
                     num_warps: int | None = None, split_k: int | None = None,
                     denormal: bool | None = None) -> Int4RowsConfig:
    """INT4_ROWS_TUNED on CUDA where listed and nothing else is given (block_n aside where it is the
    tuned one: a repacked copy's, built from that config), else INT4_ROWS_DEFAULT with the given
    fields; split_k, unless given, fills every SM's resident programs within the family's
    PARTIALS_MAX_SHARE."""
    tuned = INT4_ROWS_TUNED.get((n, k)) if device.type == "cuda" else None
    if tuned is not None and block_n in (None, tuned.block_n) and num_warps is None and split_k is None \
            and denormal is None:
        return tuned
    default_n, default_warps, resident = INT4_ROWS_DEFAULT
    block_n, num_warps = block_n or default_n, num_warps or default_warps
    if block_n & (block_n - 1) or num_warps & (num_warps - 1):
        raise ValueError(f"int4 rows kernel: block_n and num_warps must be powers of two ({block_n}, {num_warps})")
    wanted = triton.cdiv(resident * num_sms(device), triton.cdiv(n, block_n))
    affordable = int(PARTIALS_MAX_SHARE * k * BYTES_PER_WEIGHT["int4"] / 4)
    split_k = split_k or max(1, min(wanted, affordable, k // group))
    return Int4RowsConfig(block_n, num_warps, split_k, bool(denormal))


def int4_rows_gemv(x: torch.Tensor, weight: torch.Tensor | Int4RowsWeight, scales: torch.Tensor | None = None,
                   zeros: torch.Tensor | None = None, group: int = 0, pdl: bool = False, gated: bool = False,
                   **overrides) -> torch.Tensor:
    """x [1, K] times int4 weights -> [1, N] in x's dtype, with _int4_rows_kernel: weight either our
    packed codes [N, K // 2] with float32 scales / zeros [N, K // group] (read as stored), or an
    Int4RowsWeight (its block_n fixes the config's). pdl: launch with PDL. gated (a paired
    Int4RowsWeight only): [1, N / 2], silu(y[:, :N/2]) * y[:, N/2:] as ops/activation.silu_and_mul
    computes it. overrides: Int4RowsConfig fields."""
    x = x.contiguous()
    m, k = x.shape
    assert m == 1, "the int4 rows kernel takes one row"
    repacked = isinstance(weight, Int4RowsWeight)
    paired = repacked and weight.paired
    assert paired or not gated, "the gated output needs a paired Int4RowsWeight"
    if repacked:
        n, group = weight.n, weight.group
        overrides["block_n"] = weight.block_n
        w, s, z, stride_ww, stride_sn = weight.codes, weight.scale_zero, weight.scale_zero, 0, 0
    else:
        n = weight.shape[0]
        assert group % 32 == 0 and weight.stride(1) == 1 and weight.stride(0) % 4 == 0 \
            and weight.data_ptr() % 16 == 0, "int4 rows kernel: 16-byte aligned rows, groups of 32 columns"
        w, s, z, stride_ww, stride_sn = weight, scales, zeros, weight.stride(0) // 4, scales.stride(0)
    config = int4_rows_config(n, k, group, x.device, **overrides)
    groups = k // group
    per_split = triton.cdiv(groups, min(config.split_k, groups))
    splits = triton.cdiv(groups, per_split)
    n_blocks = triton.cdiv(n, config.block_n)
    y = torch.empty((1, n // 2 if gated else n), dtype=x.dtype, device=x.device)
    partials = counters = y
    if splits > 1:
        assert n_blocks <= MAX_SPLIT_BLOCKS, f"{n_blocks} row blocks: raise MAX_SPLIT_BLOCKS or block_n"
        partials = torch.empty((splits, 1, n), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device)
    _int4_rows_kernel[(n_blocks, splits)](
        x, w, s, z, y, partials, counters, n, k, stride_ww, stride_sn, per_split,
        GROUP=group, BLOCK_N=config.block_n, REPACKED=repacked, DENORMAL=config.denormal, SPLIT=splits > 1,
        PAIRED=paired, GATED=gated, num_warps=config.num_warps, **pdl_launch(pdl))
    return y
