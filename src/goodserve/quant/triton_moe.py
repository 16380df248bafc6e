"""Fused mixture of experts on CUDA (the approach of vLLM's fused_moe): the (token, slot) pairs are
sorted by expert and padded to whole blocks of BLOCK_M rows, each block one expert's (one launch);
then each projection is ONE grouped-GEMM launch whose programs each multiply one block of rows by one
tile of their expert's weights. A decode step reads each routed expert's weights once, with no per-expert
launch and no host synchronisation (the sort is on the device and sized by the token count alone,
so a CUDA graph captures it).

Decode (at most GEMV_MAX_PAIRS pairs) skips the sort: the gate | up projection is one GEMV per pair,
each program reading its pair's expert id and streaming BLOCK_N rows of that expert K-contiguous on
the CUDA cores, as the dense layers' GEMV does (ops/triton_gemv.py's _row_times_weights); the down
projection is one launch that takes SwiGLU in its load and sums a token's slots, weighted, itself
(_down_sum_kernel); the router's linear and the routing are one launch before them (_router_kernel).
With a pair or two per expert, the grouped GEMM's 16-row tiles are mostly padding and its
[BLOCK_K, BLOCK_N] weight tiles load far below the bandwidth a decode step is bound by; the GEMV's
loads are 16-byte vectors. Float and int8 stacks take it (int4 keeps the grouped GEMM);
moe_kernel_for chooses, from shapes and the stacks' layout alone (a CUDA graph captures either path).

Computes quant/moe.py's moe_torch (the reference), the router weights applied to the down projection's
rows before the sum over slots. Quantized stacks (model/moe.QuantizedExperts): the kernel loads the
codes (half / a quarter of bf16's bytes). Int8 codes go to the dot in the activation dtype (exact
there) and each output column's scale, which factors out of the sum over K, multiplies the float32
accumulator; int4 codes are dequantized in the tile (scale and zero per group along K).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from goodserve.ops.activation import silu_and_mul
from goodserve.ops.kernel_choice import KernelChoice
from goodserve.ops.pdl import pdl_launch, pdl_sync
from goodserve.ops.triton_ops import scaled_rms_norm
from goodserve.ops.triton_gemv import (DEFAULT_TILES, MAX_SPLIT_BLOCKS, _finish_split, _row_times_weights,
                                      default_config, num_sms, split_counters, split_plan)
from goodserve.quant.moe import Stack, stack_rows
from goodserve.quant import schemes

# The kernels' B_FORMAT; FLOAT and INT8 are ops/triton_gemv's DENSE and INT8 (its _row_times_weights reads them).
FLOAT, INT8, INT4 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# Decode's path: at most this many (token, slot) pairs run as one GEMV per pair (_pair_gemv_kernel),
# no sort. Each pair streams its expert's weights on its own, so an expert two pairs share is read
# twice, while the grouped GEMM's 16-row tiles hold a row or two per expert at decode and read their
# weights in [BLOCK_K, BLOCK_N] tiles, far off the bytes floor. At Qwen3-30B-A3B's widths (128
# experts, top 8) on an H100 the GEMV took 35 / 60 / 100 / 170 us at 1 / 2 / 4 / 8 tokens against the
# grouped GEMM's 47 / 72 / 115 / 198, and 648 us against 448 at 64 tokens (512 pairs), where experts
# are shared often and the grouped GEMM reads each once for all its rows (gpu_moe_gemv_h100.json).
GEMV_MAX_PAIRS = 64
# The GEMV path's down projection: slots of a token one program takes (a divisor of top k; fewer than
# top k: the slots' partial sums meet in the last program of the tile to arrive). At Qwen3-30B-A3B's
# widths on an H100 the whole MoE took 32.0 / 55.2 / 102.1 / 177.7 us at 1 / 2 / 4 / 8 tokens with 2,
# against 33.5 / 55.7 / 100.9 / 178.8 with 1, 34.5 / 54.0 / 100.2 / 180.5 with 4 and 40.1 / 57.9 /
# 109.1 / 184.9 with all 8 (benchmarks/results/gpu_moe_e861849_h100.json).
DOWN_SLOTS_PER_PROGRAM = 2


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, weights_ptr, scales_ptr, zeros_ptr, sorted_pairs_ptr, block_experts_ptr,
                         num_padded_ptr, n, k, num_pairs, stride_a, stride_be, stride_bn, stride_c,
                         A_ROW_DIVISOR: tl.constexpr, MUL_WEIGHTS: tl.constexpr, B_FORMAT: tl.constexpr,
                         GROUP_SIZE: tl.constexpr, PACK: tl.constexpr, PRECISION: tl.constexpr,
                         UPCAST_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """C[pair] = A[pair // A_ROW_DIVISOR] @ B[expert].T (times the pair's router weight) for one
    block of sorted pairs and one tile of N. Pairs are token * top_k + slot; padding is num_pairs.
    B_FORMAT: FLOAT; INT8 (B[expert] = codes * scales[expert * n + column]); INT4 (two codes a byte,
    even column low, B = code * scale + zero per group of GROUP_SIZE columns, quant/schemes.py).
    PACK: codes a byte of B (2 for INT4)."""
    pdl_sync(USE_PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < n
    weight_rows = expert * n + cols.to(tl.int64)  # the columns' rows in the stack (scales' index)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // A_ROW_DIVISOR).to(tl.int64)[:, None] * stride_a + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + cols.to(tl.int64)[None, :] * stride_bn + (offs_k // PACK)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        in_k = offs_k + k0 < k
        a = tl.load(a_ptrs, mask=valid[:, None] & in_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=in_k[:, None] & in_n[None, :], other=0)
        if B_FORMAT == INT4:
            codes = (b.to(tl.int32) >> ((offs_k % 2) * 4)[:, None]) & 0xF
            groups = weight_rows[None, :] * (k // GROUP_SIZE) + ((offs_k + k0) // GROUP_SIZE)[:, None]
            in_tile = in_k[:, None] & in_n[None, :]
            b = codes.to(tl.float32) * tl.load(scales_ptr + groups, mask=in_tile, other=0.0) \
                + tl.load(zeros_ptr + groups, mask=in_tile, other=0.0)
        if UPCAST_DOT:  # the interpreter's bf16 dot (and casts to bf16) are wrong: float32 operands on the CPU
            a, b = a.to(tl.float32), b.to(tl.float32)
        elif B_FORMAT != FLOAT:
            b = b.to(a.dtype)
        acc += tl.dot(a, b, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K // PACK
    if B_FORMAT == INT8:  # a row's scale factors out of its sum over K
        acc *= tl.load(scales_ptr + weight_rows, mask=in_n, other=0.0)[None, :]
    out = acc.to(c_ptr.dtype.element_ty)
    if MUL_WEIGHTS:  # as the reference: the expert's output and its weight rounded, then multiplied
        weight = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(c_ptr.dtype.element_ty)
        out = (out.to(tl.float32) * weight[:, None].to(tl.float32)).to(c_ptr.dtype.element_ty)
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_c + cols[None, :]
    tl.store(c_ptrs, out, mask=valid[:, None] & in_n[None, :])


@triton.jit
def _top_k_softmax(logits, experts, num_experts, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """One token's float32 logits [BLOCK_E] -> (weights, ids) [BLOCK_K]: softmax over the experts, its
    TOP_K largest (the first of equals), renormalised to sum 1 where asked: quant/moe.py's route."""
    logits = tl.where(experts < num_experts, logits, float("-inf"))
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(probs, axis=0)
        weights = tl.where(slots == j, tl.max(probs, axis=0), weights)
        ids = tl.where(slots == j, best, ids)
        probs = tl.where(experts == best, -1.0, probs)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    return weights, ids


@triton.jit
def _store_route(weights_ptr, ids_ptr, row, weights, ids, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    slots = tl.arange(0, BLOCK_K)
    tl.store(weights_ptr + row * TOP_K + slots, weights, mask=slots < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slots, ids, mask=slots < TOP_K)


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_logits, TOP_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """One token's routing (_top_k_softmax) from its logits."""
    pdl_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + row * stride_logits + experts, mask=experts < num_experts).to(tl.float32)
    weights, ids = _top_k_softmax(logits, experts, num_experts, TOP_K, RENORMALIZE, BLOCK_K)
    _store_route(weights_ptr, ids_ptr, row, weights, ids, TOP_K, BLOCK_K)


def triton_route(router_logits: torch.Tensor, top_k: int, renormalize: bool, pdl: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """route's result ([T, k] float32 weights, [T, k] int32 expert ids) in one launch."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
                                    RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts),
                                    BLOCK_K=triton.next_power_of_2(top_k), num_warps=1, **pdl_launch(pdl))
    return weights, ids


@triton.jit
def _pair_gemv_kernel(a_ptr, b_ptr, c_ptr, scales_ptr, ids_ptr, n, k, stride_a, stride_bn, stride_c,
                      A_ROW_DIVISOR: tl.constexpr, B_FORMAT: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr):
    """C[pair, tile] = A[pair // A_ROW_DIVISOR] @ B[ids[pair]][tile].T for one pair and one tile of
    BLOCK_N rows of its expert: ops/triton_gemv's one-row stream (_row_times_weights: K-contiguous
    steps on the CUDA cores, in float32, no TF32). B_FORMAT: FLOAT or INT8 (codes times
    scales[expert * n + row])."""
    pdl_sync(USE_PDL)
    pair, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    a_row = a_ptr + (pair // A_ROW_DIVISOR).to(tl.int64) * stride_a
    acc = _row_times_weights(a_row, b_ptr + expert * n * stride_bn, scales_ptr, scales_ptr, offs_n, n_mask, 0, k,
                             stride_bn, 0, B_FORMAT, 1, BLOCK_K, EVEN_K)
    if B_FORMAT == INT8:  # a row's scale factors out of its sum over K
        acc *= tl.load(scales_ptr + expert * n + offs_n, mask=n_mask, other=0.0)
    tl.store(c_ptr + pair.to(tl.int64) * stride_c + offs_n, acc.to(c_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _down_sum_kernel(gate_up_ptr, b_ptr, out_ptr, weights_ptr, scales_ptr, ids_ptr, part_ptr, count_ptr, n, k,
                     stride_gu, stride_bn, stride_out, TOP_K: tl.constexpr, SLOTS: tl.constexpr,
                     B_FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     SPLIT: tl.constexpr, USE_PDL: tl.constexpr):
    """out[token, tile] = the sum over the token's TOP_K slots of weight * SwiGLU(gate_up[pair]) @
    B[ids[pair]][tile].T, for one tile of BLOCK_N rows: program (tile, SLOTS slots, token). The
    activation is taken in the load (ops/triton_gemv's _load_x), the router weight (rounded to the
    activation dtype, as the reference rounds it) and the sum over slots in float32 before one
    rounding: the silu_and_mul and the sum kernels drop out of a decode step. With SPLIT, each
    program's slots are a partial that the token's last program of the tile to arrive sums in slot
    order (ops/triton_gemv's deterministic split finish)."""
    pdl_sync(USE_PDL)
    pid_n, part, token = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in tl.static_range(SLOTS):
        pair = token * TOP_K + part * SLOTS + i
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        rows = _row_times_weights(gate_up_ptr + pair.to(tl.int64) * stride_gu, b_ptr + expert * n * stride_bn,
                                  scales_ptr, scales_ptr, offs_n, n_mask, 0, k, stride_bn, 0, B_FORMAT, 1, BLOCK_K,
                                  EVEN_K, k, True)
        if B_FORMAT == INT8:
            rows *= tl.load(scales_ptr + expert * n + offs_n, mask=n_mask, other=0.0)
        acc += rows * tl.load(weights_ptr + pair).to(out_ptr.dtype.element_ty).to(tl.float32)
    offs_m = token + tl.arange(0, 1)
    out_ptrs = out_ptr + offs_m[None, :] * stride_out + offs_n[:, None]
    if SPLIT:
        _finish_split(acc[:, None], part_ptr, count_ptr, out_ptrs, offs_n, offs_m, n_mask[:, None],
                      tl.num_programs(2), n, token * tl.num_programs(0) + pid_n, part)
    else:
        tl.store(out_ptrs, acc[:, None].to(out_ptr.dtype.element_ty), mask=n_mask[:, None])


@triton.jit
def _norm_slice(sub_ptr, res_ptr, norm_w_ptr, x_ptr, new_res_ptr, row_start, k, k_start, k_stop, eps,
                store_residual, BLOCK_H: tl.constexpr):
    """The residual add + RMSNorm before the MoE (ops/triton_ops' _rms_norm_kernel, rounded where it
    rounds) of the row starting at row_start, normed whole, stored in [k_start, k_stop) only: into x,
    and into the new residual where store_residual. The barrier makes the slice visible to this
    program's threads; other programs of the slice store the same values."""
    cols = tl.arange(0, BLOCK_H)
    in_row = cols < k
    summed = (tl.load(sub_ptr + row_start + cols, mask=in_row, other=0.0).to(tl.float32)
              + tl.load(res_ptr + row_start + cols, mask=in_row, other=0.0).to(tl.float32))
    summed = summed.to(new_res_ptr.dtype.element_ty)
    weight = tl.load(norm_w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    in_slice = in_row & (cols >= k_start) & (cols < k_stop)
    tl.store(x_ptr + row_start + cols, scaled_rms_norm(summed, weight, k, eps, 0.0).to(x_ptr.dtype.element_ty),
             mask=in_slice)
    if store_residual:
        tl.store(new_res_ptr + row_start + cols, summed, mask=in_slice)
    tl.debug_barrier()


@triton.jit
def _router_kernel(x_ptr, w_ptr, part_ptr, count_ptr, weights_ptr, ids_ptr, sub_ptr, res_ptr, norm_w_ptr,
                   new_res_ptr, num_experts, k, stride_x, stride_w, steps_per_split, eps, TOP_K: tl.constexpr,
                   RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOP: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, NORM: tl.constexpr, BLOCK_H: tl.constexpr,
                   USE_PDL: tl.constexpr):
    """The router's linear and the routing in one launch: program (tile of BLOCK_N experts, K slice,
    token) stores its slice's float32 partial logits [slices, T, E] (ops/triton_gemv's one-row
    stream); the token's last program to arrive sums them in slice order, rounds the logits to the
    activation dtype as the router's linear leaves them, and routes (_top_k_softmax). NORM: x is made
    first, from the sublayer's output and the residual (_norm_slice; the first tile of experts stores
    the new residual), so the norm's launch drops out of a decode step."""
    pdl_sync(USE_PDL)
    pid_n, split, token = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_tokens = tl.num_programs(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < num_experts
    k_start = split * steps_per_split * BLOCK_K
    k_stop = tl.minimum(k_start + steps_per_split * BLOCK_K, k)
    if NORM:
        _norm_slice(sub_ptr, res_ptr, norm_w_ptr, x_ptr, new_res_ptr, token * stride_x, k, k_start, k_stop, eps,
                    pid_n == 0, BLOCK_H)
    partial = _row_times_weights(x_ptr + token * stride_x, w_ptr, w_ptr, w_ptr, offs_n, n_mask, k_start, k_stop,
                                 stride_w, 0, FLOAT, 1, BLOCK_K, EVEN_K)
    tl.store(part_ptr + (split * num_tokens + token) * num_experts + offs_n, partial, mask=n_mask)
    tl.debug_barrier()  # every thread's partial is written before the counter says so
    arrived = tl.atomic_add(count_ptr + token, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
        experts = tl.arange(0, BLOCK_E)
        logits = tl.zeros([BLOCK_E], dtype=tl.float32)
        for s in range(0, tl.num_programs(1)):  # .cg: the other SMs' partials from L2, not a stale L1
            logits += tl.load(part_ptr + (s * num_tokens + token) * num_experts + experts,
                              mask=experts < num_experts, other=0.0, cache_modifier=".cg")
        logits = logits.to(x_ptr.dtype.element_ty).to(tl.float32)
        weights, ids = _top_k_softmax(logits, experts, num_experts, TOP_K, RENORMALIZE, BLOCK_TOP)
        _store_route(weights_ptr, ids_ptr, token, weights, ids, TOP_K, BLOCK_TOP)
        tl.atomic_xchg(count_ptr + token, 0)


@dataclass(frozen=True)
class PairTiles:
    """The GEMV path's launch of one projection: BLOCK_N of an expert's rows a program, BLOCK_K deep a
    step (ops/triton_gemv's one-row tile); slots: the down launch's slots of a token a program takes
    (a divisor of top k; None: its greatest common divisor with DOWN_SLOTS_PER_PROGRAM)."""
    block_n: int
    block_k: int
    num_warps: int
    slots: int | None = None


@dataclass(frozen=True)
class GroupedTiles:
    """The grouped GEMM's launch: BLOCK_M sorted pairs (one expert's) by BLOCK_N columns a program,
    BLOCK_K deep a step; the sort pads each expert's pairs to whole BLOCK_M blocks."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def grouped_tiles_for(num_pairs: int) -> GroupedTiles:
    """Small blocks where most experts hold a pair or two (decode), larger for prefill. Not yet swept on
    a card: `benchmarks/gpu_moe.py --parts grouped-sweep` times candidates by token count."""
    return GroupedTiles(16 if num_pairs <= 256 else 64, 64, 64, num_warps=4, num_stages=3)


@triton.jit
def _sort_pairs_kernel(ids_ptr, sorted_pairs_ptr, block_experts_ptr, num_padded_ptr, num_pairs, num_experts,
                       max_blocks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
                       USE_PDL: tl.constexpr):
    """One program: count each expert's pairs, lay the experts' runs out padded to whole blocks, write
    each pair at its expert's start plus its rank among that expert's pairs (stable), and each
    block's expert. One launch where the torch ops would take a dozen (a decode step pays each)."""
    pdl_sync(USE_PDL)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK_P):
        pairs = start + tl.arange(0, BLOCK_P)
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    for b0 in range(0, max_blocks, BLOCK_P):
        blocks = b0 + tl.arange(0, BLOCK_P)
        owner = tl.sum(((ends[None, :] <= blocks[:, None] * BLOCK_M) & (experts[None, :] < num_experts)).to(tl.int32),
                       axis=1)
        tl.store(block_experts_ptr + blocks, tl.minimum(owner, num_experts - 1), mask=blocks < max_blocks)
        for m in range(0, BLOCK_M):  # padding everywhere first; the pairs overwrite their slots below
            tl.store(sorted_pairs_ptr + blocks * BLOCK_M + m, num_pairs, mask=blocks < max_blocks)
    tl.debug_barrier()
    seen = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK_P):
        pairs = start + tl.arange(0, BLOCK_P)
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(onehot, axis=0) - onehot + seen[None, :]  # earlier pairs of the same expert
        slot = tl.sum((starts[None, :] + before) * onehot, axis=1)
        tl.store(sorted_pairs_ptr + slot, pairs, mask=pairs < num_pairs)
        seen += tl.sum(onehot, axis=0)


def sort_pairs_by_expert(ids: torch.Tensor, num_experts: int, block_m: int, pdl: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted_pairs [max_blocks * block_m]: pair indices grouped by expert, each
    expert's run padded with num_pairs to whole blocks; block_experts [max_blocks]; num_padded [1]:
    rows in use). max_blocks bounds the padding by the experts that can be hit (at most T * k)."""
    num_pairs = ids.numel()
    max_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    _sort_pairs_kernel[(1,)](ids.flatten().to(torch.int32), sorted_pairs, block_experts, num_padded, num_pairs,
                             num_experts, max_blocks, BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts),
                             BLOCK_P=64, num_warps=4, **pdl_launch(pdl))
    return sorted_pairs, block_experts, num_padded


def _grouped_gemm(a: torch.Tensor, b: Stack, num_experts: int, out: torch.Tensor, sorted_pairs: torch.Tensor,
                  block_experts: torch.Tensor, num_padded: torch.Tensor, num_pairs: int, a_row_divisor: int,
                  tiles: GroupedTiles, pdl: bool, weights: torch.Tensor | None = None) -> None:
    """out [num_pairs, N] = a's rows @ the [N, K] weight of each pair's expert in stack b."""
    codes = getattr(b, "qweight", b)
    n, k = stack_rows(b) // num_experts, a.shape[1]
    b_format = _format_of(b)
    grid = (block_experts.numel(), triton.cdiv(n, tiles.block_n))
    _grouped_gemm_kernel[grid](
        a, codes, out, weights if weights is not None else out, getattr(b, "scales", out), getattr(b, "zeros", out),
        sorted_pairs, block_experts, num_padded, n, k, num_pairs, a.stride(0), n * codes.stride(0), codes.stride(0),
        out.stride(0), A_ROW_DIVISOR=a_row_divisor, MUL_WEIGHTS=weights is not None, B_FORMAT=b_format,
        GROUP_SIZE=getattr(b, "group_size", 1), PACK=2 if b_format == INT4.value else 1,
        PRECISION="ieee" if a.dtype == torch.float32 or not a.is_cuda else None,  # float32 stays exact (no TF32)
        UPCAST_DOT=not a.is_cuda,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **pdl_launch(pdl))


def _format_of(stack: Stack) -> int:
    return {schemes.Int4Weight: INT4, schemes.Int8Weight: INT8}.get(type(stack), FLOAT).value


def _streams_as_words(stack: Stack) -> bool:
    """Whether _pair_gemv_kernel can take the stack: float rows, or int8 rows it reads as int32 words
    (rows of whole words, 4-byte aligned)."""
    codes = getattr(stack, "qweight", stack)
    return _format_of(stack) == FLOAT.value or (
        _format_of(stack) == INT8.value and codes.stride(0) % 4 == 0 and codes.data_ptr() % 4 == 0)


def moe_kernel_for(num_pairs: int, w13: Stack, w2: Stack) -> str:
    """"gemv" (one GEMV per pair, no sort) for decode's few pairs where both stacks allow it, else
    "grouped" (sort, then grouped GEMMs). Shapes and the stacks' layout alone decide: a CUDA graph
    captures either."""
    return "gemv" if num_pairs <= GEMV_MAX_PAIRS and _streams_as_words(w13) and _streams_as_words(w2) else "grouped"


def pair_tiles_for(stack: Stack, k: int) -> PairTiles:
    """The GEMV family's one-row tile for the stack's format, BLOCK_K cut to the largest power of two
    dividing K (whole, unmasked steps). At Qwen3-30B-A3B's shapes on an H100 a sweep's fastest tiles
    (`benchmarks/gpu_moe.py --parts pair-sweep`) took each launch alone 2-3% less at 1 token, and
    batch-1 decode 0.6% longer (gpu_moe_pair_sweep_030b6df_h100.json): these stay."""
    block_n, block_k, num_warps = DEFAULT_TILES["int8" if _format_of(stack) == INT8.value else "dense", 1][:3]
    return PairTiles(block_n, min(block_k, max(k & -k, 16)), num_warps)


def _pair_gemv(a: torch.Tensor, b: Stack, num_experts: int, out: torch.Tensor, ids: torch.Tensor,
               a_row_divisor: int, tiles: PairTiles, pdl: bool = False) -> None:
    """out [num_pairs, N] = a's rows @ the [N, K] weight of each pair's expert in stack b, one
    program per (pair, BLOCK_N rows)."""
    assert _streams_as_words(b), "the per-pair GEMV takes float stacks and word-aligned int8 ones"
    codes = getattr(b, "qweight", b)
    n, k = stack_rows(b) // num_experts, a.shape[1]
    _pair_gemv_kernel[(ids.numel(), triton.cdiv(n, tiles.block_n))](
        a, codes, out, getattr(b, "scales", out), ids, n, k, a.stride(0), codes.stride(0), out.stride(0),
        A_ROW_DIVISOR=a_row_divisor, B_FORMAT=_format_of(b), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        EVEN_K=k % tiles.block_k == 0, num_warps=tiles.num_warps, **pdl_launch(pdl))


def _down_sum(gate_up: torch.Tensor, w2: Stack, hidden: int, weights: torch.Tensor, ids: torch.Tensor,
              tiles: PairTiles, pdl: bool = False) -> torch.Tensor:
    """[T, hidden]: each token's sum over its slots of weight * SwiGLU(gate_up[pair]) @ w2[expert].T in
    one launch (_down_sum_kernel), tiles.slots of a token's slots a program."""
    assert _streams_as_words(w2), "the down projection's GEMV takes float stacks and word-aligned int8 ones"
    num_tokens, top_k = ids.shape
    slots = tiles.slots or math.gcd(DOWN_SLOTS_PER_PROGRAM, top_k)
    assert top_k % slots == 0, f"a down program's slots must divide top k ({top_k}), got {slots}"
    codes = getattr(w2, "qweight", w2)
    k = gate_up.shape[1] // 2
    block_n, block_k, num_warps = tiles.block_n, tiles.block_k, tiles.num_warps
    out = gate_up.new_empty(num_tokens, hidden)
    row_blocks, parts = triton.cdiv(hidden, block_n), top_k // slots
    partials = counters = out  # unused without a split
    if parts > 1:
        blocks = num_tokens * row_blocks
        assert blocks <= MAX_SPLIT_BLOCKS, f"{blocks} row blocks: raise MAX_SPLIT_BLOCKS"
        partials = torch.empty(parts, num_tokens, hidden, dtype=torch.float32, device=out.device)
        counters = split_counters(out.device)
    _down_sum_kernel[(row_blocks, parts, num_tokens)](
        gate_up, codes, out, weights, getattr(w2, "scales", out), ids, partials, counters, hidden, k,
        gate_up.stride(0), codes.stride(0), out.stride(0), TOP_K=top_k, SLOTS=slots, B_FORMAT=_format_of(w2),
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, SPLIT=parts > 1, num_warps=num_warps,
        **pdl_launch(pdl))
    return out


@dataclass(frozen=True)
class SublayerNorm:
    """The residual add + RMSNorm that makes the MoE's input: (normed, new residual) =
    ops/norm.add_rms_norm(sublayer_out, residual, weight, eps), into the two buffers given."""
    sublayer_out: torch.Tensor
    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    new_residual: torch.Tensor


def triton_router(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool, pdl: bool = False,
                  norm: SublayerNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """triton_route(x @ router_weight.T, ...) in one launch (_router_kernel), for decode's few tokens:
    the router's [E, H] weight is small, so its GEMV is latency, and the routing launch after it
    would be as long again. With norm, x is an empty buffer the launch fills with the norm's output."""
    num_tokens, hidden = x.shape
    num_experts = router_weight.shape[0]
    assert router_weight.stride(-1) == 1 and x.stride(-1) == 1, "the router's GEMV needs K-contiguous rows"
    if norm is not None:
        rows = (x, norm.sublayer_out, norm.residual, norm.new_residual)
        assert all(t.is_contiguous() and t.shape == x.shape for t in rows), "the norm's rows are x's shape, contiguous"
        assert len({t.dtype for t in rows + (norm.weight,)}) == 1, "the norm's inputs, weight and x share a dtype"
    config = default_config("dense", 1, num_experts, hidden, 1, num_sms(x.device))
    splits, steps_per_split = split_plan(hidden, config.block_k, config.split_k)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=x.device)
    if num_tokens:
        assert num_tokens <= MAX_SPLIT_BLOCKS
        partials = torch.empty(splits, num_tokens, num_experts, dtype=torch.float32, device=x.device)
        sub, res, norm_weight, new_res, eps = ((norm.sublayer_out, norm.residual, norm.weight, norm.new_residual,
                                                norm.eps) if norm else (x, x, x, x, 0.0))  # unread without a norm
        _router_kernel[(triton.cdiv(num_experts, config.block_n), splits, num_tokens)](
            x, router_weight, partials, split_counters(x.device), weights, ids, sub, res, norm_weight, new_res,
            num_experts, hidden, x.stride(0), router_weight.stride(0), steps_per_split, eps, TOP_K=top_k,
            RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_TOP=triton.next_power_of_2(top_k), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            EVEN_K=hidden % config.block_k == 0, NORM=norm is not None, BLOCK_H=triton.next_power_of_2(hidden),
            num_warps=config.num_warps, **pdl_launch(pdl))
    return weights, ids


def triton_norm_router(sublayer_out: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       router_weight: torch.Tensor, top_k: int, renormalize: bool, pdl: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, new residual, weights, ids): ops/norm.add_rms_norm(sublayer_out, residual, norm_weight, eps)
    and triton_router(x, ...) in one launch, for decode's few tokens."""
    x, new_residual = torch.empty_like(sublayer_out), torch.empty_like(residual)
    norm = SublayerNorm(sublayer_out, residual, norm_weight, eps, new_residual)
    return (x, new_residual) + triton_router(x, router_weight, top_k, renormalize, pdl, norm)


def triton_moe(x: torch.Tensor, router_weight: torch.Tensor, w13: Stack, w2: Stack, top_k: int, renormalize: bool,
               kernels: KernelChoice) -> torch.Tensor:
    """The MoE block on CUDA: routing, then the experts (triton_fused_moe). Decode's few tokens take the
    router's linear and the routing in one launch (triton_router); more take cuBLAS and triton_route."""
    if moe_kernel_for(x.shape[0] * top_k, w13, w2) == "gemv":
        weights, ids = triton_router(x, router_weight, top_k, renormalize, kernels.pdl)
    else:
        weights, ids = triton_route(x @ router_weight.T, top_k, renormalize, kernels.pdl)
    return triton_fused_moe(x, w13, w2, weights, ids, kernels)


def triton_fused_moe(x: torch.Tensor, w13: Stack, w2: Stack, weights: torch.Tensor, ids: torch.Tensor,
                     kernels: KernelChoice, path: str | None = None, down_slots: int | None = None,
                     tiles: GroupedTiles | None = None, pair_tiles: tuple[PairTiles, PairTiles] | None = None
                     ) -> torch.Tensor:
    """x [T, H], w13 [E * 2I, H], w2 [E * H, I] (float, or their codes: quant/moe.py's Stack),
    weights / ids [T, k] -> [T, H]. path: "gemv" or "grouped" (benchmarks force one), else
    moe_kernel_for's choice. The launches a benchmark's sweep may set, else the defaults: tiles, the
    grouped path's (grouped_tiles_for); pair_tiles, the GEMV path's gate | up and down
    (pair_tiles_for); down_slots, the down launch's slots a program (PairTiles.slots)."""
    num_tokens, hidden = x.shape
    num_experts, top_k = stack_rows(w2) // hidden, ids.shape[1]
    num_pairs = num_tokens * top_k
    x = x.contiguous()
    gate_up = x.new_empty(num_pairs, stack_rows(w13) // num_experts)
    if (path or moe_kernel_for(num_pairs, w13, w2)) == "gemv":
        gate_up_tiles, down_tiles = pair_tiles or (pair_tiles_for(w13, hidden),
                                                   pair_tiles_for(w2, gate_up.shape[1] // 2))
        _pair_gemv(x, w13, num_experts, gate_up, ids.reshape(-1), top_k, gate_up_tiles, kernels.pdl)
        if down_slots:
            down_tiles = replace(down_tiles, slots=down_slots)
        return _down_sum(gate_up, w2, hidden, weights.contiguous(), ids.contiguous(), down_tiles, kernels.pdl)
    down = x.new_empty(num_pairs, hidden)
    tiles = tiles or grouped_tiles_for(num_pairs)
    sorting = sort_pairs_by_expert(ids, num_experts, tiles.block_m, kernels.pdl)
    _grouped_gemm(x, w13, num_experts, gate_up, *sorting, num_pairs, top_k, tiles, kernels.pdl)
    _grouped_gemm(silu_and_mul(gate_up, kernels), w2, num_experts, down, *sorting, num_pairs, 1, tiles, kernels.pdl,
                  weights.flatten())
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
