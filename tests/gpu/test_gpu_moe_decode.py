"""The fused MoE's decode path (quant/triton_moe.py: the router's linear with the routing in one launch,
one GEMV per (token, slot) pair for gate | up, one launch for SwiGLU, the down projection and the sum
over slots) compiled on CUDA at Qwen3-30B-A3B's expert widths, where the CPU suite's interpreter cannot check what compiling
changes (int8 codes read as int32 words, 16-byte vector loads of whole K steps): against the grouped
GEMM path and the torch path on the same device and weights."""

from __future__ import annotations

import pytest
import torch

from goodserve.ops.kernel_choice import TORCH_KERNELS, KernelChoice
from goodserve.quant import schemes
from goodserve.quant.moe import moe_torch, route
from goodserve.ops.triton_ops import triton_add_rms_norm
from goodserve.quant.triton_moe import moe_kernel_for, triton_fused_moe, triton_norm_router, triton_router

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
    # All of a token's slots in one down program, or one slot a program whose partials the last to
    # arrive adds up: the same float32 sum in the same (slot) order, up to the compiler's fused
    # multiply-adds (one program's acc += rows * weight is one FMA; a partial's product is rounded).
    whole, one_each = (triton_fused_moe(x, w13, w2, weights, ids, kernels, path="gemv", down_slots=slots).float()
                       for slots in (TOP_K, 1))
    step = 1e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(whole, one_each, rtol=step, atol=step * scale)


@pytest.mark.parametrize("num_tokens", [1, 8])
def test_router_kernel_picks_a_top_k_of_the_routers_bf16_logits(num_tokens, device, cuda_only):
    """Qwen3-30B-A3B's router (128 experts, top 8) in bf16: the launch's experts are a top k of the
    cuBLAS logits up to a step of bf16 (the two sum in other orders, so a near tie may round either
    way), and its weights the renormalised softmax of those logits at the experts it picked."""
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(device, torch.bfloat16)
    router = (torch.randn(128, HIDDEN, generator=g) * 0.02).to(device, torch.bfloat16)
    weights, ids = triton_router(x, router, TOP_K, renormalize=True)
    logits = (x @ router.T).float()
    kth_largest = logits.topk(TOP_K, dim=-1).values[:, -1:]
    step = kth_largest.abs() * 2**-7
    picked = logits.gather(1, ids.long())
    assert (picked >= kth_largest - step).all()
    assert (ids.sort(dim=-1).values.diff(dim=-1) != 0).all()  # k distinct experts
    expected = torch.softmax(logits, dim=-1).gather(1, ids.long())
    torch.testing.assert_close(weights, expected / expected.sum(dim=-1, keepdim=True), rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("num_tokens", [1, 8])
def test_the_norm_inside_the_router_launch_is_the_norm_launchs_in_bf16(num_tokens, device, cuda_only):
    """KernelOptions.moe_norm_router's launch compiled, in bf16 at Qwen3-30B-A3B's router (128 experts,
    top 8): the norm's rows and the new residual bit for bit those of the norm's own launch, and the
    route the router launch's of those rows."""
    g = torch.Generator().manual_seed(num_tokens)
    sublayer_out, residual = (torch.randn(num_tokens, HIDDEN, generator=g).to(device, torch.bfloat16) for _ in "ab")
    norm_weight = (torch.rand(HIDDEN, generator=g) + 0.5).to(device, torch.bfloat16)
    router = (torch.randn(128, HIDDEN, generator=g) * 0.02).to(device, torch.bfloat16)
    for pdl in (False, True):
        x, new_residual, weights, ids = triton_norm_router(sublayer_out, residual, norm_weight, 1e-6, router, TOP_K,
                                                           True, pdl)
        norm_x, norm_residual = triton_add_rms_norm(sublayer_out, residual, norm_weight, 1e-6)
        assert torch.equal(x, norm_x) and torch.equal(new_residual, norm_residual)
        router_weights, router_ids = triton_router(norm_x, router, TOP_K, True)
        assert torch.equal(ids, router_ids) and torch.equal(weights, router_weights)
