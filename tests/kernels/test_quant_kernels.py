"""int8_matmul / int4_matmul (under the interpreter) against x @ dequantized(W)^T in plain torch: the
GEMV family below GEMV_MAX_M rows (tests/kernels/test_triton_gemv.py covers its paths), the GEMMs above."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from goodserve.config import KernelOptions  # noqa: E402
from goodserve.ops.kernel_choice import KernelChoice  # noqa: E402
from goodserve.quant import schemes  # noqa: E402
from goodserve.quant.triton_kernels import GEMV_MAX_M, int4_matmul, int8_matmul  # noqa: E402

# (M, N, K): GEMV rows 1 / 3 / its limit, GEMM rows past it, N not a multiple of any block
SHAPES = [(1, 40, 128), (3, 70, 256), (GEMV_MAX_M, 40, 192), (GEMV_MAX_M + 1, 50, 128), (70, 96, 192)]


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


def test_int8_rows_of_odd_length_take_the_gemm():
    """The GEMV reads int8 codes as 4-byte words; K = 70 goes to the GEMM kernel instead."""
    torch.manual_seed(4)
    x, w = torch.randn(2, 70), torch.randn(24, 70)
    q = schemes.quantize_int8(w)
    torch.testing.assert_close(int8_matmul(x, q.qweight, q.scales), x @ schemes.dequantize_int8(q).T,
                               rtol=1e-4, atol=1e-4)


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


def test_int4_layer_past_the_tinygemm_rows_goes_straight_to_triton(monkeypatch, caplog):
    """KernelOptions.int4_tinygemm_max_m picks the kernel: past it the layer never builds tinygemm's layout."""
    from torch import nn

    from goodserve.quant import linear as qlinear

    torch.manual_seed(5)
    layer = qlinear.Int4Linear.from_linear(nn.Linear(128, 32), 64)
    layer.kernels = KernelChoice(options=KernelOptions(int4_tinygemm_max_m=0))
    x = torch.randn(1, 128).to(torch.bfloat16)
    with caplog.at_level("WARNING", logger="goodserve.quant"):
        out = layer._cuda_matmul(x)
    assert not layer.tinygemm_disabled and layer._tinygemm is None and not caplog.text
    torch.testing.assert_close(out.float(), x.float() @ layer.dequantize().T, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("kernel", ["rows", "rows_repacked"])
def test_int4_layer_takes_the_rows_kernel_it_was_built_with(monkeypatch, kernel):
    """KernelOptions.int4_one_row_kernel picks one-row calls' kernel (int4_rows_configs its launch);
    other row counts keep their paths, and the repacked copy is rebuilt when the codes change."""
    from torch import nn

    from goodserve.ops import triton_gemv
    from goodserve.quant import linear as qlinear

    torch.manual_seed(9)
    layer = qlinear.Int4Linear.from_linear(nn.Linear(256, 40), 64)
    layer.kernels = KernelChoice(options=KernelOptions(int4_one_row_kernel=kernel,
                                                       int4_rows_configs={(40, 256): {"block_n": 8, "split_k": 2}}))
    calls = []
    real = triton_gemv.int4_rows_gemv
    monkeypatch.setattr(triton_gemv, "int4_rows_gemv",
                        lambda *a, **kw: calls.append((a[1], kw["split_k"])) or real(*a, **kw))
    x = torch.randn(1, 256)
    torch.testing.assert_close(layer._cuda_matmul(x), x @ layer.dequantize().T, rtol=1e-2, atol=1e-2)
    assert len(calls) == 1 and isinstance(calls[0][0], triton_gemv.Int4RowsWeight) == (kernel == "rows_repacked")
    assert calls[0][1] == 2
    layer.zeros.add_(1.0)  # in place: the repacked copy must follow
    torch.testing.assert_close(layer._cuda_matmul(x), x @ layer.dequantize().T, rtol=1e-2, atol=1e-2)
    layer._cuda_matmul(torch.randn(3, 256))
    assert len(calls) == 2


def test_an_unknown_one_row_kernel_is_refused_and_a_shape_entry_wins():
    from goodserve.config import EngineConfig
    from goodserve.errors import InvalidRequestError
    from goodserve.quant import linear as qlinear

    for options in (KernelOptions(int4_one_row_kernel="marlin"),
                    KernelOptions(int4_one_row_kernel_by_shape={(40, 256): "marlin"})):
        with pytest.raises(InvalidRequestError, match="one-row"):
            EngineConfig(kernels=options).validate()
    choice = KernelChoice(options=KernelOptions(int4_one_row_kernel_by_shape={(40, 256): "rows"}))
    layers = qlinear.Int4Linear(256, 40, group_size=64), qlinear.Int4Linear(256, 48, group_size=64)
    for layer in layers:
        layer.kernels = choice
    assert [layer.one_row_kernel for layer in layers] == ["rows", "tinygemm"]
