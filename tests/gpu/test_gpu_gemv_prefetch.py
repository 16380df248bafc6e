"""The GEMV's weight prefetch (ops/triton_gemv._prefetch_rows: inline PTX issued before the PDL
wait, which the CPU suite's interpreter cannot run) compiled and launched on CUDA at Llama-3.1-8B's
shapes, dense and int8: the prefetch only warms L2, so every size gives the output of none, bit for
bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from goodserve.ops.triton_gemv import dense_gemv
from goodserve.quant import schemes
from goodserve.quant.triton_kernels import int8_matmul

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "down_proj": (4096, 14336), "ragged": (1000, 4096)}


@pytest.mark.parametrize("name", SHAPES)
def test_prefetch_leaves_the_output_bit_for_bit(name, device, cuda_only):
    n, k = SHAPES[name]
    g = torch.Generator().manual_seed(n + k)
    weight = (torch.randn(n, k, generator=g) * 0.02).to(device, torch.bfloat16)
    x = torch.randn(1, k, generator=g).to(device, torch.bfloat16)
    plain = dense_gemv(x, weight, pdl=True)
    for prefetch_bytes in (4 << 10, 16 << 10, 1 << 20):
        assert torch.equal(dense_gemv(x, weight, pdl=True, prefetch_bytes=prefetch_bytes), plain)
    torch.testing.assert_close(plain.float(), F.linear(x, weight).float(), rtol=2e-2, atol=2e-3)
    codes = schemes.quantize_int8(weight.float())
    plain = int8_matmul(x, codes.qweight, codes.scales, pdl=True)
    for prefetch_bytes in (4 << 10, 1 << 20):
        assert torch.equal(int8_matmul(x, codes.qweight, codes.scales, pdl=True, prefetch_bytes=prefetch_bytes), plain)
