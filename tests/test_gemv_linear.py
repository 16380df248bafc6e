"""GemvLinear (ops/gemv_linear.py) under TRITON_INTERPRET=1: one row through the Triton GEMV, more rows
through F.linear, both equal to nn.Linear; only the shapes with a measured win are swapped."""

import pytest
import torch
from torch import nn

from goodserve.ops import attention
from goodserve.ops.gemv_linear import GemvLinear, gemv_wins
from goodserve.ops.triton_gemv import TUNED_CONFIGS, GemvConfig


@pytest.fixture
def triton_backend():
    attention.set_attention_backend("triton")
    yield
    attention.set_attention_backend("auto")


@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_linear_equals_linear(triton_backend, monkeypatch, rows):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    monkeypatch.setitem(TUNED_CONFIGS, ("dense", 1, 48, 64), GemvConfig(1, 16, 32, 4, 1, 2))
    x = torch.randn(rows, 64)
    with torch.no_grad():
        want = linear(x)
        got = GemvLinear(linear)(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_only_measured_shapes_and_16_bit_weights_are_swapped():
    lm_head = nn.Linear(4096, 128256, bias=False, device="meta", dtype=torch.bfloat16)
    qkv = nn.Linear(4096, 6144, bias=False, device="meta", dtype=torch.bfloat16)  # cuBLAS won there
    assert gemv_wins(lm_head) and not gemv_wins(qkv)
    assert not gemv_wins(nn.Linear(4096, 128256, bias=False, device="meta", dtype=torch.float32))
