"""Triton dequantize-matmul kernels for weight-only int8 / int4: y[M, N] = x[M, K] @ W^T.

Weights never exist dequantized in memory: each program loads its tile of codes, widens them in
registers and multiplies. Decode (small M) is bound by reading the weight bytes: the int8 GEMV
(M <= GEMV_MAX_M) splits K as well as N across programs, because an N-only grid leaves the long-K
layers (down_proj: N 4096, K 14336) with too few programs in flight to keep HBM busy; the splits'
float32 partial sums are added by a second, deterministic kernel. Prefill (large M) is bound by
compute, so the GEMM kernels feed tensor cores through tl.dot.

Scales are applied outside the K-inner products: int8 per channel once at the end; int4 once
per group, using sum_k x_k (q_k s + z) = s * sum_k x_k q_k + z * sum_k x_k, which lets the int4
kernels multiply raw codes. An int4 tile is one group (BLOCK_K == group_size); its packed bytes
hold even columns in the low nibble and odd columns in the high one, so x is read as its even
and odd columns rather than interleaving the codes. On CUDA with bfloat16 activations the int4
layer uses torch's tinygemm kernel instead (quant/linear.py); the int4 kernels here are its
fallback.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

GEMV_MAX_M = 16  # int8: rows up to the largest decode batch that pads into one tl.dot tile
INT4_GEMV_MAX_M = 8
# Split K until about this many GEMV programs per SM are in flight: enough loads outstanding to
# cover HBM latency. Shapes alone decide the split, so a captured CUDA graph stays valid.
GEMV_PROGRAMS_PER_SM = 8
INTERPRETER_SMS = 4  # CPU (TRITON_INTERPRET): small, so that tests exercise the split path
SUM_BLOCK = 1024


@triton.jit
def _int8_splitk_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_wn, k_per_split,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             DOT_PRECISION: tl.constexpr):
    """Program (n block, split) writes out[split, :M, n block] = x[:, split's K slice] @ W^T * scale.

    One row (BLOCK_M == 1) multiplies and sums on the CUDA cores; more rows pad to 16 and go
    through tl.dot, so extra rows cost tensor-core time, not another pass of CUDA-core math.
    """
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask, m_mask = offs_n < N, offs_m < M
    k_start = tl.program_id(1) * k_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        offs_k = k_start + k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if BLOCK_M == 1:
            acc += tl.sum(w.to(tl.float32) * tl.trans(x.to(tl.float32)), axis=0)[None, :]
        else:
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    out = out_ptr + tl.program_id(1) * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, y_ptr, numel, splits, BLOCK: tl.constexpr):
    """y = partials[0] + ... + partials[splits - 1], in a fixed order (deterministic, no atomics)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, splits):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int4_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, K // GROUP):
        offs_b = g * (GROUP // 2) + tl.arange(0, GROUP // 2)  # byte columns of this group
        packed = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_b[None, :], mask=n_mask[:, None], other=0)
        low = (packed & 0xF).to(tl.float32)
        high = (packed >> 4).to(tl.float32)
        scales = tl.load(s_ptr + offs_n * stride_sn + g, mask=n_mask, other=0.0)
        zeros = tl.load(z_ptr + offs_n * stride_sn + g, mask=n_mask, other=0.0)
        for m in tl.static_range(BLOCK_M):
            x_row = x_ptr + tl.minimum(m, M - 1) * stride_xm + 2 * offs_b  # see the int8 GEMV
            x_even = tl.load(x_row).to(tl.float32)
            x_odd = tl.load(x_row + 1).to(tl.float32)
            dot = tl.sum(low * x_even[None, :] + high * x_odd[None, :], axis=1)
            part = dot * scales + (tl.sum(x_even) + tl.sum(x_odd)) * zeros
            acc = tl.where(rows[:, None] == m, acc + part[None, :], acc)
    y_mask = (rows[:, None] < M) & n_mask[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _int8_gemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0.0)
        w_mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    scales = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)
    acc = acc * scales[None, :]
    y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _int4_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, K // GROUP):
        offs_b = g * (GROUP // 2) + tl.arange(0, GROUP // 2)
        x_rows = x_ptr + offs_m[:, None] * stride_xm + 2 * offs_b[None, :]
        x_even = tl.load(x_rows, mask=m_mask[:, None], other=0.0)
        x_odd = tl.load(x_rows + 1, mask=m_mask[:, None], other=0.0)
        packed = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_b[:, None], mask=n_mask[None, :], other=0)
        low = (packed & 0xF).to(x_even.dtype)
        high = (packed >> 4).to(x_even.dtype)
        dot = tl.dot(x_even, low, input_precision=DOT_PRECISION)
        dot = tl.dot(x_odd, high, dot, input_precision=DOT_PRECISION)
        x_sum = tl.sum(x_even.to(tl.float32), axis=1) + tl.sum(x_odd.to(tl.float32), axis=1)
        scales = tl.load(s_ptr + offs_n * stride_sn + g, mask=n_mask, other=0.0)
        zeros = tl.load(z_ptr + offs_n * stride_sn + g, mask=n_mask, other=0.0)
        acc += dot * scales[None, :] + x_sum[:, None] * zeros[None, :]
    y_mask = m_mask[:, None] & n_mask[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=y_mask)


def _gemv_block_n(n: int) -> int:
    # Small tiles keep enough programs in flight to saturate HBM when N is only a few thousand.
    return 16 if n <= 8192 else 32


def _dot_precision(x: torch.Tensor) -> str:
    # float32 activations: exact products (no TF32 rounding), as the CPU reference computes them
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _gemm_block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 64 else 64


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def gemv_splits(n_blocks: int, k: int, block_k: int, num_sms: int, split_k: int | None = None) -> tuple[int, int]:
    """(splits, K columns per split): split_k, or enough splits for GEMV_PROGRAMS_PER_SM programs
    per SM. K per split is a whole number of BLOCK_K tiles, so only the last split is ragged."""
    k_blocks = triton.cdiv(k, block_k)
    wanted = split_k or GEMV_PROGRAMS_PER_SM * num_sms // n_blocks
    per_split = triton.cdiv(k_blocks, max(1, min(k_blocks, wanted))) * block_k
    return triton.cdiv(k, per_split), per_split


def _int8_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, block_n: int | None,
               block_k: int | None, split_k: int | None) -> torch.Tensor:
    m, k = x.shape
    n = qweight.shape[0]
    block_m = 1 if m == 1 else 16  # tl.dot needs 16 rows at least; the padding rows read nothing
    block_n = block_n or (16 if m == 1 else 32)
    block_k = block_k or (512 if m == 1 else 256)
    n_blocks = triton.cdiv(n, block_n)
    splits, per_split = gemv_splits(n_blocks, k, block_k, _sm_count(x.device), split_k)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    out = y if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    _int8_splitk_gemv_kernel[(n_blocks, splits)](
        x, qweight, scales, out, m, n, k, x.stride(0), qweight.stride(0), per_split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=_dot_precision(x))
    if splits > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](out, y, m * n, splits, BLOCK=SUM_BLOCK)
    return y


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, *,
                block_n: int | None = None, block_k: int | None = None,
                split_k: int | None = None) -> torch.Tensor:
    """x [M, K] (fp32/fp16/bf16), qweight [N, K] int8, scales [N] fp32 -> [M, N] in x's dtype.

    block_n / block_k / split_k override the tile sizes and the GEMV's K split (benchmarks/gpu_quant.py
    sweeps them)."""
    x = x.contiguous()
    m, k = x.shape
    if m <= GEMV_MAX_M:
        return _int8_gemv(x, qweight, scales, block_n, block_k, split_k)
    n = qweight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m, block_n = _gemm_block_m(m), block_n or 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int8_gemm_kernel[grid](x, qweight, scales, y, m, n, k, x.stride(0), qweight.stride(0), y.stride(0),
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k or 64,
                            DOT_PRECISION=_dot_precision(x))
    return y


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, *, block_n: int | None = None) -> torch.Tensor:
    """x [M, K], qweight [N, K // 2] uint8, scales / zeros [N, K // group_size] fp32 -> [M, N]."""
    x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    strides = (x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0))
    if m <= INT4_GEMV_MAX_M:
        block_n = block_n or _gemv_block_n(n)
        _int4_gemv_kernel[(triton.cdiv(n, block_n),)](
            x, qweight, scales, zeros, y, m, n, k, *strides,
            GROUP=group_size, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n)
        return y
    block_m, block_n = _gemm_block_m(m), block_n or 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](x, qweight, scales, zeros, y, m, n, k, *strides,
                            GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n,
                            DOT_PRECISION=_dot_precision(x))
    return y
