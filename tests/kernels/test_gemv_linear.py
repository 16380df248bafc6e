"""GemvLinear (ops/gemv_linear.py) under TRITON_INTERPRET=1: the row counts with a tuned dense entry
through the Triton GEMV, others through F.linear, all equal to nn.Linear; only the shapes and row
counts with a measured win are routed."""

import functools

import pytest
import torch
from torch import nn

from goodserve.model.llama import LlamaAttention
from goodserve.model.spec import ModelSpec
from goodserve.model.tensor_parallel import TensorParallel
from goodserve.ops import gemv_linear
from goodserve.ops.gemv_linear import GemvLinear, gemv_wins
from goodserve.ops.kernel_choice import KernelChoice
from goodserve.ops.triton_gemv import TUNED_CONFIGS, GemvConfig, dense_gemv


@pytest.mark.parametrize("rows, tuned_rows", [(1, 1), (3, 1), (3, 16), (16, 16)])
def test_gemv_linear_equals_linear(monkeypatch, rows, tuned_rows):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True, dtype=torch.bfloat16)  # the GEMV takes 16-bit weights
    tile = GemvConfig(1, 16, 32, 4, 1, 2) if tuned_rows == 1 else GemvConfig(16, 16, 32, 2, 1, 2)
    monkeypatch.setitem(TUNED_CONFIGS, ("dense", tuned_rows, 48, 64), tile)
    calls = []
    monkeypatch.setattr(gemv_linear, "dense_gemv", functools.partial(_recording_gemv, calls))
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        want = linear(x)
        got = GemvLinear(linear, KernelChoice(triton=True))(x)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # bf16 outputs, summed in another order
    assert len(calls) == (1 if (rows == 1) == (tuned_rows == 1) else 0)  # the GEMV took exactly its rows


def _recording_gemv(calls, x, weight, pdl):
    calls.append(x.shape[0])
    return dense_gemv(x, weight, pdl)


def test_only_measured_shapes_rows_and_16_bit_weights_are_routed(monkeypatch):
    lm_head = nn.Linear(4096, 128256, bias=False, device="meta", dtype=torch.bfloat16)
    assert gemv_wins(lm_head, 1) and not gemv_wins(lm_head, 7)  # one-row entry only
    assert not gemv_wins(nn.Linear(4096, 128256, bias=False, device="meta", dtype=torch.float32), 1)
    assert not gemv_wins(nn.Linear(4096, 5000, bias=False, device="meta", dtype=torch.bfloat16), 1)
    monkeypatch.setitem(TUNED_CONFIGS, ("dense", 16, 128256, 4096), GemvConfig(16, 16, 512, 2, 4, 1))
    assert gemv_wins(lm_head, 2) and gemv_wins(lm_head, 16) and not gemv_wins(lm_head, 17)


@pytest.mark.parametrize("weight_offset", [0.0, 1.0])  # Qwen3's q/k norms, Gemma 3's
def test_attention_heads_through_the_gemv_and_the_qk_norm_kernel(monkeypatch, weight_offset):
    """LlamaAttention.project_heads with its qkv projection on the GEMV and the Triton q/k norm: the
    heads equal nn.Linear's then the torch norm's."""
    spec = ModelSpec(name="tiny", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=32, max_position_embeddings=64, qk_norm=True,
                     norm_weight_offset=weight_offset)
    torch.manual_seed(0)
    attention = LlamaAttention(spec, TensorParallel()).to(torch.bfloat16)
    with torch.no_grad():
        for norm in (attention.q_norm, attention.k_norm):
            norm.weight.normal_(1.0, 0.3)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    want = [t.clone() for t in attention.project_heads(x)]  # torch kernels, nn.Linear
    monkeypatch.setitem(TUNED_CONFIGS, ("dense", 1, 256, 64), GemvConfig(1, 16, 32, 4, 1, 2))
    calls = []
    monkeypatch.setattr(gemv_linear, "dense_gemv", functools.partial(_recording_gemv, calls))
    kernels = KernelChoice(triton=True)
    attention.kernels = attention.q_norm.kernels = attention.k_norm.kernels = kernels
    attention.qkv_proj = GemvLinear(attention.qkv_proj, kernels)
    with torch.no_grad():
        got = attention.project_heads(x)
    assert calls == [1]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)  # bf16, products summed in another order
