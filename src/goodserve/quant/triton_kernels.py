"""Triton dequantize-matmul kernels for weight-only int8 / int4: y[M, N] = x[M, K] @ W^T.

Weights never exist dequantized in memory: each program loads its tile of codes, widens them in
registers and multiplies. Decode (M <= GEMV_MAX_M) is bound by reading the weight bytes and goes
through the GEMV family in ops/triton_gemv.py (one kernel for dense, int8 and int4 weights; its
doc says how it streams them). Prefill-sized M is bound by compute: the GEMM kernels here feed
tensor cores through tl.dot.

Scales are applied outside the K-inner products: int8 per channel once at the end; int4 once
per group, using sum_k x_k (q_k s + z) = s * sum_k x_k q_k + z * sum_k x_k, which lets the int4
kernels multiply raw codes. An int4 GEMM tile is one group (BLOCK_K == group_size); its packed
bytes hold even columns in the low nibble and odd columns in the high one, so x is read as its
even and odd columns rather than interleaving the codes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from goodserve.ops.pdl import pdl_launch, pdl_sync
from goodserve.ops.triton_gemv import GEMV_MAX_M, gemv


@triton.jit
def _int8_gemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_sync(USE_PDL)
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
                      DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_sync(USE_PDL)
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


def _dot_precision(x: torch.Tensor) -> str:
    # float32 activations: exact products (no TF32 rounding), as the CPU reference computes them
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _gemm_block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 64 else 64


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, pdl: bool = False,
                **gemv_overrides) -> torch.Tensor:
    """x [M, K] (fp32/fp16/bf16), qweight [N, K] int8, scales [N] fp32 -> [M, N] in x's dtype.

    pdl: launch with PDL (ops/pdl.py). gemv_overrides: GemvConfig fields for the GEMV (block_n,
    block_k, split_k, ...; the benchmark sweeps them)."""
    x = x.contiguous()
    m, k = x.shape
    if m <= GEMV_MAX_M and k % 4 == 0:
        return gemv(x, qweight, "int8", scales, pdl=pdl, **gemv_overrides)
    n = qweight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m, block_n = _gemm_block_m(m), 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int8_gemm_kernel[grid](x, qweight, scales, y, m, n, k, x.stride(0), qweight.stride(0), y.stride(0),
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, DOT_PRECISION=_dot_precision(x),
                            **pdl_launch(pdl))
    return y


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, pdl: bool = False, **gemv_overrides) -> torch.Tensor:
    """x [M, K], qweight [N, K // 2] uint8, scales / zeros [N, K // group_size] fp32 -> [M, N]."""
    x = x.contiguous()
    m, k = x.shape
    if m <= GEMV_MAX_M:
        return gemv(x, qweight, "int4", scales, zeros, group_size, pdl=pdl, **gemv_overrides)
    n = qweight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m, block_n = _gemm_block_m(m), 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](x, qweight, scales, zeros, y, m, n, k, x.stride(0), qweight.stride(0), scales.stride(0),
                            y.stride(0), GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n,
                            DOT_PRECISION=_dot_precision(x), **pdl_launch(pdl))
    return y
