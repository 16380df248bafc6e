"""Triton dequantize-GEMV / GEMM (under the interpreter) against x @ dequantized(W)^T in plain torch."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from goodserve.quant import schemes  # noqa: E402
from goodserve.quant.triton_kernels import GEMV_MAX_M, int4_matmul, int8_matmul  # noqa: E402

# (M, N, K): GEMV rows 1 / 3 / GEMV_MAX_M, GEMM rows past it, N not a multiple of any block
SHAPES = [(1, 40, 128), (3, 70, 256), (GEMV_MAX_M, 33, 128), (GEMV_MAX_M + 1, 50, 128), (70, 96, 192)]


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int8_kernel_matches_reference(m, n, k):
    torch.manual_seed(m * n)
    x, w = torch.randn(m, k), torch.randn(n, k)
    q = schemes.quantize_int8(w)
    torch.testing.assert_close(int8_matmul(x, q.qweight, q.scales), x @ schemes.dequantize_int8(q).T,
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_kernel_matches_reference(m, n, k, group_size):
    torch.manual_seed(m * n + group_size)
    x, w = torch.randn(m, k), torch.randn(n, k) + 0.3  # offset: zero points must matter
    q = schemes.quantize_int4(w, group_size)
    out = int4_matmul(x, q.qweight, q.scales, q.zeros, group_size)
    torch.testing.assert_close(out, x @ schemes.dequantize_int4(q).T, rtol=1e-4, atol=1e-4)


def test_kernels_keep_half_precision_inputs():
    torch.manual_seed(1)
    x, w = torch.randn(20, 128, dtype=torch.float16), torch.randn(64, 128)
    q = schemes.quantize_int4(w, 128)
    out = int4_matmul(x, q.qweight, q.scales, q.zeros, 128)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), x.float() @ schemes.dequantize_int4(q).T, rtol=2e-2, atol=5e-2)
