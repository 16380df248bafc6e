"""The fused MoE's decode path (quant/triton_moe.py: one GEMV per (token, slot) pair) compiled on CUDA
at Qwen3-30B-A3B's expert widths, where the CPU suite's interpreter cannot check what compiling
changes (int8 codes read as int32 words, 16-byte vector loads of whole K steps): against the grouped
GEMM path and the torch path on the same device and weights."""

from __future__ import annotations

import pytest
import torch

from goodserve.ops.kernel_choice import TORCH_KERNELS, KernelChoice
from goodserve.quant import schemes
from goodserve.quant.moe import moe_torch, route
from goodserve.quant.triton_moe import moe_kernel_for, triton_fused_moe

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 16, 8  # Qwen3-30B-A3B's widths and top k, fewer experts


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 2, 8])  # 8 tokens at top 8: GEMV_MAX_PAIRS
def test_decode_gemv_matches_grouped_gemm_and_torch_path(num_tokens, dtype, quantization, device, cuda_only):
    g = torch.Generator().manual_seed(num_tokens)
    w13 = (torch.randn(EXPERTS * 2 * INTER, HIDDEN, generator=g) * 0.02).to(device, dtype)
    w2 = (torch.randn(EXPERTS * HIDDEN, INTER, generator=g) * 0.02).to(device, dtype)
    if quantization == "int8":
        w13, w2 = schemes.quantize_int8(w13.float()), schemes.quantize_int8(w2.float())
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(device, dtype)
    weights, ids = route(torch.randn(num_tokens, EXPERTS, generator=g).to(device), TOP_K, renormalize=True)
    assert moe_kernel_for(ids.numel(), w13, w2) == "gemv"
    kernels = KernelChoice(triton=True)
    gemv = triton_fused_moe(x, w13, w2, weights, ids, kernels, path="gemv").float()
    grouped = triton_fused_moe(x, w13, w2, weights, ids, kernels, path="grouped").float()
    reference = moe_torch(x, w13, w2, weights, ids, TORCH_KERNELS).float()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: intermediate roundings in other places
    scale = reference.abs().max().item()
    torch.testing.assert_close(gemv, reference, rtol=tolerance, atol=tolerance * scale)
    torch.testing.assert_close(gemv, grouped, rtol=tolerance, atol=tolerance * scale)
