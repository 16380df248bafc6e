"""Triton dequantize-GEMV / GEMM (under the interpreter) against x @ dequantized(W)^T in plain torch."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from goodserve.quant import schemes  # noqa: E402
from goodserve.quant.triton_kernels import (GEMV_MAX_M, INT4_GEMV_MAX_M, gemv_splits, int4_matmul,  # noqa: E402
                                            int8_matmul)

# (M, N, K): GEMV rows 1 / 3 / the GEMVs' limits, GEMM rows past them, N not a multiple of any block
SHAPES = [(1, 40, 128), (3, 70, 256), (INT4_GEMV_MAX_M, 33, 128), (INT4_GEMV_MAX_M + 1, 50, 128),
          (GEMV_MAX_M, 40, 192), (GEMV_MAX_M + 1, 50, 128), (70, 96, 192)]


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int8_kernel_matches_reference(m, n, k):
    torch.manual_seed(m * n)
    x, w = torch.randn(m, k), torch.randn(n, k)
    q = schemes.quantize_int8(w)
    torch.testing.assert_close(int8_matmul(x, q.qweight, q.scales), x @ schemes.dequantize_int8(q).T,
                               rtol=1e-4, atol=1e-4)


# (M, N, K, block_k, split_k): K a whole number of splits, a ragged last split (K 320 = 2.5 tiles of
# 128), more splits wanted than K tiles, and the automatic split (None) for one and several rows.
SPLITS = [(1, 24, 512, 128, 4), (5, 24, 320, 128, 2), (1, 16, 256, 64, 64), (2, 24, 384, 128, 3),
          (1, 40, 1024, 128, None), (9, 40, 1024, 128, None)]


@pytest.mark.parametrize("m,n,k,block_k,split_k", SPLITS)
def test_int8_split_k_gemv_matches_reference(m, n, k, block_k, split_k):
    torch.manual_seed(k + m)
    x, w = torch.randn(m, k), torch.randn(n, k)
    q = schemes.quantize_int8(w)
    out = int8_matmul(x, q.qweight, q.scales, block_n=16, block_k=block_k, split_k=split_k)
    torch.testing.assert_close(out, x @ schemes.dequantize_int8(q).T, rtol=1e-4, atol=1e-4)


def test_gemv_splits_cover_k_exactly_once():
    for n_blocks, k, block_k, sms, split_k in [(256, 14336, 512, 132, None), (1792, 4096, 512, 132, None),
                                               (2, 320, 128, 4, 2), (1, 256, 64, 4, 64)]:
        splits, per_split = gemv_splits(n_blocks, k, block_k, sms, split_k)
        assert per_split % block_k == 0 and (splits - 1) * per_split < k <= splits * per_split
    assert gemv_splits(256, 14336, 512, 132) == (4, 3584)  # down_proj at M = 1 on an H100: 1024 programs
    assert gemv_splits(1792, 4096, 512, 132) == (1, 4096)  # gate_up_proj: N alone fills the GPU


def test_int8_gemv_keeps_half_precision_inputs():
    torch.manual_seed(2)
    x, w = torch.randn(4, 256, dtype=torch.float16), torch.randn(32, 256)
    q = schemes.quantize_int8(w)
    out = int8_matmul(x, q.qweight, q.scales, block_k=64, split_k=2)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), x.float() @ schemes.dequantize_int8(q).T, rtol=2e-2, atol=5e-2)


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


def test_int4_layer_falls_back_to_triton_when_tinygemm_is_unavailable(caplog):
    """On the CPU the CUDA tinygemm ops do not exist: the layer must warn once and serve the
    Triton kernel's result instead of raising (the same path a GPU takes if the op is missing)."""
    from torch import nn

    from goodserve.quant.linear import Int4Linear

    torch.manual_seed(3)
    layer = Int4Linear.from_linear(nn.Linear(128, 32), 64)
    x = torch.randn(2, 128).to(torch.bfloat16)
    with caplog.at_level("WARNING", logger="goodserve.quant"):
        out = layer._cuda_matmul(x)
    assert layer.tinygemm_disabled and "tinygemm kernel unavailable" in caplog.text
    assert out.dtype == torch.bfloat16
    ref = x.float() @ layer.dequantize().T
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=5e-2)
