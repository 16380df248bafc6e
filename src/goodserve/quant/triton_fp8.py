"""Per-token FP8 quantization of activation rows on CUDA in one launch (quant/fp8_linear.py's
quantize_rows): each program reads its row twice, once for the amax and once to scale and cast,
where the torch ops take five launches and a float32 copy of the rows. It computes what
fp8_linear.quantize_rows_torch does (the reference the tests compare it with), bit for bit:
scale = amax * (1 / 448), codes = round-to-nearest-even(x / scale) clamped to +-448.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from goodserve.quant import schemes

BLOCK_K = 1024
INV_FP8_MAX = 1.0 / schemes.FP8_MAX
NUM_WARPS = 4


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scales_ptr, k, stride_x, stride_q, FP8_MAX: tl.constexpr,
                          INV_FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        in_k = k0 + offs < k
        v = tl.load(x_ptr + row * stride_x + k0 + offs, mask=in_k, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.max(amax, axis=0) * INV_FP8_MAX, MIN_SCALE)
    tl.store(scales_ptr + row, scale)
    for k0 in range(0, k, BLOCK_K):
        in_k = k0 + offs < k
        v = tl.load(x_ptr + row * stride_x + k0 + offs, mask=in_k, other=0.0).to(tl.float32)
        # div_rn: IEEE division, as torch's of two tensors (Triton's `/` on float32 may be off by an ulp)
        codes = tl.clamp(tl.div_rn(v, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_q + k0 + offs, codes.to(tl.float8e4nv), mask=in_k)


def quantize_rows_fp8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] (unit stride along K) -> (float8_e4m3fn [M, K], float32 scales [M, 1])."""
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape
    q = torch.empty(m, k, dtype=schemes.FP8_DTYPE, device=rows.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=rows.device)
    if m:
        _quantize_rows_kernel[(m,)](rows, q, scales, k, rows.stride(0), q.stride(0), FP8_MAX=schemes.FP8_MAX,
                                    INV_FP8_MAX=INV_FP8_MAX, MIN_SCALE=schemes.MIN_SCALE,
                                    BLOCK_K=min(BLOCK_K, triton.next_power_of_2(k)), num_warps=NUM_WARPS)
    return q, scales
