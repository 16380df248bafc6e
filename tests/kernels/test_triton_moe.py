"""The fused MoE (quant/triton_moe.py) under TRITON_INTERPRET=1 (tests/conftest.py sets it) against a
plain per-token reference written here, and the CPU path (quant/moe.py) against the same reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from goodserve.config import KernelOptions
from goodserve.model.llama import RMSNorm
from goodserve.model.moe import SparseMoE
from goodserve.model.presets import get_preset
from goodserve.ops.kernel_choice import TORCH_KERNELS, KernelChoice
from goodserve.ops.norm import add_rms_norm_torch
from goodserve.ops.triton_ops import triton_add_rms_norm
from goodserve.quant.moe import moe_torch, route
from goodserve.quant import schemes
from goodserve.quant.triton_moe import (GEMV_MAX_PAIRS, GroupedTiles, PairTiles, moe_kernel_for, sort_pairs_by_expert,
                                        triton_fused_moe, triton_norm_router, triton_route, triton_router)

HIDDEN, INTER, EXPERTS = 64, 48, 4


def reference(x, w13, w2, weights, ids):
    """Token by token, slot by slot: sum of weight * down(silu(gate x) * up x) of each routed expert."""
    experts = w2.shape[0] // HIDDEN
    gate_up, down = w13.view(experts, 2 * INTER, HIDDEN).double(), w2.view(experts, HIDDEN, INTER).double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for weight, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (gate_up[e] @ x[t].double()).chunk(2)
            out[t] += weight * (down[e] @ (F.silu(gate) * up))
    return out


def moe_inputs(num_tokens: int, top_k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(dtype)
    w13 = (torch.randn(EXPERTS * 2 * INTER, HIDDEN, generator=g) / 8).to(dtype)
    w2 = (torch.randn(EXPERTS * HIDDEN, INTER, generator=g) / 8).to(dtype)
    # Skewed logits: some experts get many tokens, some none.
    logits = torch.randn(num_tokens, EXPERTS, generator=g) + torch.tensor([2.0, 1.0, 0.0, -3.0])
    weights, ids = route(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("num_tokens", [1, 7, 150])  # 150 x 2 pairs take the prefill's 64-row blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_matches_the_reference(num_tokens: int, dtype: torch.dtype):
    x, w13, w2, weights, ids = moe_inputs(num_tokens, 2, dtype)
    ours = triton_fused_moe(x, w13, w2, weights, ids, KernelChoice(triton=True))
    ref = reference(x, w13, w2, weights.to(dtype), ids)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ours.double(), ref, rtol=tolerance, atol=tolerance * ref.abs().max().item())


# Tiles a sweep (benchmarks/gpu_moe.py --parts grouped-sweep) may pick: blocks wider than an expert's
# pairs, columns and depth past the projections' (96 and 64 wide, 64 and 48 deep here).
@pytest.mark.parametrize("tiles", [GroupedTiles(32, 128, 128, 8, 4), GroupedTiles(128, 256, 64, 8, 3)])
def test_the_grouped_gemm_at_other_tiles_matches_the_reference(tiles: GroupedTiles):
    x, w13, w2, weights, ids = moe_inputs(150, 2, torch.float32)
    ours = triton_fused_moe(x, w13, w2, weights, ids, KernelChoice(triton=True), path="grouped", tiles=tiles)
    ref = reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def routed_inputs(ids: list[list[int]], dtype: torch.dtype, experts: int = 8, seed: int = 4):
    """Inputs for a routing given as expert ids [T, k], with random router weights summing to 1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(ids)
    x = torch.randn(ids.shape[0], HIDDEN, generator=g).to(dtype)
    w13 = (torch.randn(experts * 2 * INTER, HIDDEN, generator=g) / 8).to(dtype)
    w2 = (torch.randn(experts * HIDDEN, INTER, generator=g) / 8).to(dtype)
    weights = torch.softmax(torch.randn(ids.shape, generator=g), dim=-1)
    return x, w13, w2, weights, ids


# Decode's routings (the per-pair GEMV's): one token at top 2..8, and two tokens sharing experts 3 and 6.
DECODE_ROUTINGS = {"1 token top 2": [[5, 2]], "1 token top 5": [[7, 0, 3, 1, 6]],
                   "1 token top 8": [[7, 0, 3, 1, 6, 2, 5, 4]], "2 tokens sharing": [[3, 6, 1, 4], [6, 0, 3, 7]]}
FAST_ROUTINGS = ("1 token top 8", "2 tokens sharing")  # the others in the full tier


@pytest.mark.parametrize("routing", [r if r in FAST_ROUTINGS else pytest.param(r, marks=pytest.mark.slow)
                                     for r in DECODE_ROUTINGS])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16])  # bf16 fast
def test_decode_gemv_matches_the_cpu_path_and_the_grouped_gemm(routing: str, dtype: torch.dtype):
    x, w13, w2, weights, ids = routed_inputs(DECODE_ROUTINGS[routing], dtype)
    assert moe_kernel_for(ids.numel(), w13, w2) == "gemv"
    gemv = triton_fused_moe(x, w13, w2, weights, ids, KernelChoice(triton=True), path="gemv")
    # All of a token's slots in one down program, or one slot a program whose partials the last to
    # arrive adds up: the same float32 sum in the same (slot) order.
    whole, one_each = (triton_fused_moe(x, w13, w2, weights, ids, KernelChoice(triton=True), path="gemv",
                                        down_slots=slots) for slots in (ids.shape[1], 1))
    assert torch.equal(whole, one_each)
    grouped = triton_fused_moe(x, w13, w2, weights, ids, KernelChoice(triton=True), path="grouped")
    cpu = moe_torch(x, w13, w2, weights, ids, TORCH_KERNELS)
    scale = cpu.abs().max().item()
    # float32: sums in another order only. bf16: the grouped GEMM rounds each slot's weighted output
    # before the sum over slots, the GEMV sums them in float32 and rounds once: within two steps of
    # bf16 (2**-7); the CPU path rounds elsewhere (as above).
    close_to_cpu, close_to_grouped = (1e-5, 1e-5) if dtype == torch.float32 else (3e-2, 2**-7)
    torch.testing.assert_close(gemv, cpu, rtol=close_to_cpu, atol=close_to_cpu * scale)
    torch.testing.assert_close(gemv, grouped, rtol=close_to_grouped, atol=close_to_grouped * scale)


# Tiles the pair sweep may pick (benchmarks/gpu_moe.py --parts pair-sweep): rows past an expert's (96 gate | up,
# 64 down), steps that do not divide the down projection's depth (48), one or four slots a down program.
@pytest.mark.parametrize("pair_tiles", [(PairTiles(8, 32, 2), PairTiles(32, 32, 8, 1)),
                                        (PairTiles(128, 128, 4), PairTiles(8, 64, 2, 4))])
def test_the_decode_gemv_at_other_tiles_matches_the_reference(pair_tiles: tuple[PairTiles, PairTiles]):
    x, w13, w2, weights, ids = routed_inputs(DECODE_ROUTINGS["1 token top 8"], torch.float32)
    ours = triton_fused_moe(x, w13, w2, weights, ids, KernelChoice(triton=True), path="gemv", pair_tiles=pair_tiles)
    ref = reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_gemv_takes_decode_pair_counts_and_float_or_int8_stacks_only():
    x, w13, w2, _, _ = routed_inputs([[0]], torch.bfloat16)
    assert moe_kernel_for(GEMV_MAX_PAIRS, w13, w2) == "gemv"
    assert moe_kernel_for(GEMV_MAX_PAIRS + 1, w13, w2) == "grouped"
    q13, q2 = schemes.quantize_int8(w13.float()), schemes.quantize_int8(w2.float())
    assert moe_kernel_for(1, q13, q2) == "gemv"
    assert moe_kernel_for(1, schemes.quantize_int4(w13.float(), 32), q2) == "grouped"
    odd = schemes.quantize_int8(torch.randn(8 * HIDDEN, 6))  # rows of 6 bytes: not whole int32 words
    assert moe_kernel_for(1, q13, odd) == "grouped"


@pytest.mark.parametrize("num_tokens", [1, 7, 150])
def test_cpu_moe_matches_the_reference(num_tokens: int):
    x, w13, w2, weights, ids = moe_inputs(num_tokens, 2, torch.float32, seed=1)
    ours = moe_torch(x, w13, w2, weights, ids, TORCH_KERNELS)
    ref = reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_pairs_sorted_by_expert_in_whole_blocks():
    ids = torch.tensor([[3, 0], [0, 2], [0, 3]])
    sorted_pairs, block_experts, num_padded = sort_pairs_by_expert(ids, num_experts=4, block_m=4)
    # expert 0: pairs 1, 2, 4; expert 2: pair 3; expert 3: pairs 0, 5 -> three blocks of four rows
    assert num_padded.tolist() == [12]
    assert sorted_pairs[:12].tolist() == [1, 2, 4, 6, 3, 6, 6, 6, 0, 5, 6, 6]
    assert block_experts[:3].tolist() == [0, 2, 3]
    assert len(sorted_pairs) == len(block_experts) * 4 >= 12  # the bound holds every routing of 6 pairs


def test_many_pairs_sort_as_a_stable_sort_by_expert():
    """More pairs and blocks than one pass of the kernel's loops takes."""
    ids = torch.randint(0, EXPERTS, (350, 2), generator=torch.Generator().manual_seed(5))
    sorted_pairs, block_experts, num_padded = sort_pairs_by_expert(ids, EXPERTS, block_m=4)
    flat, expected, blocks = ids.flatten(), [], []
    for e in range(EXPERTS):
        run = (flat == e).nonzero().flatten().tolist()
        run += [flat.numel()] * (-len(run) % 4)
        expected += run
        blocks += [e] * (len(run) // 4)
    assert num_padded.item() == len(expected)
    assert sorted_pairs[: len(expected)].tolist() == expected
    assert block_experts[: len(blocks)].tolist() == blocks


@pytest.mark.parametrize(("experts", "top_k", "renormalize"), [(4, 2, True), (128, 8, True), (60, 4, False)])
def test_routing_kernel_matches_route(experts: int, top_k: int, renormalize: bool):
    logits = torch.randn(9, experts, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    weights, ids = triton_route(logits, top_k, renormalize)
    ref_weights, ref_ids = route(logits, top_k, renormalize)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_weights)


@pytest.mark.parametrize(("experts", "top_k", "renormalize", "num_tokens"), [(128, 8, True, 1), (60, 4, False, 3),
                                                                           (4, 2, True, 2)])
def test_router_kernel_matches_the_routers_linear_then_route(experts, top_k, renormalize, num_tokens):
    """Decode's router launch (its linear split over K, the last program to arrive routing) against
    the linear and route, in float32: the interpreter truncates casts to bf16 (tests/gpu checks bf16)."""
    g = torch.Generator().manual_seed(experts)
    x = torch.randn(num_tokens, 1024, generator=g)
    router = torch.randn(experts, 1024, generator=g) / 32
    weights, ids = triton_router(x, router, top_k, renormalize)
    ref_weights, ref_ids = route(x @ router.T, top_k, renormalize)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_weights)


@pytest.mark.parametrize(("experts", "top_k", "num_tokens"), [(128, 8, 1), (60, 4, 3)])
def test_the_norm_inside_the_router_launch_is_the_norm_launchs(experts, top_k, num_tokens):
    """The residual add + RMSNorm inside the router's launch (each of 4 K slices stored by 8 or 4
    programs) gives the norm launch's rows bit for bit, the reference's up to float32 sums, and routes
    them as the router's linear and route do, in float32 (the interpreter truncates casts to bf16)."""
    g = torch.Generator().manual_seed(experts)
    sublayer_out, residual = torch.randn(2, num_tokens, 1024, generator=g)
    norm_weight = torch.rand(1024, generator=g) + 0.5
    router = torch.randn(experts, 1024, generator=g) / 32
    x, new_residual, weights, ids = triton_norm_router(sublayer_out, residual, norm_weight, 1e-6, router, top_k, True)
    norm_launch_x, norm_launch_residual = triton_add_rms_norm(sublayer_out, residual, norm_weight, 1e-6)
    assert torch.equal(x, norm_launch_x) and torch.equal(new_residual, norm_launch_residual)
    ref_x, ref_residual = add_rms_norm_torch(sublayer_out, residual, norm_weight, 1e-6)
    assert torch.equal(new_residual, ref_residual)
    torch.testing.assert_close(x, ref_x)
    ref_weights, ref_ids = route(x @ router.T, top_k, True)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_weights)


def test_a_moe_block_takes_its_norm_into_the_router_launch_only_where_asked():
    """SparseMoE.after_norm with KernelOptions.moe_norm_router: at decode's token counts one launch
    makes the norm's rows and routes them, and the block's output and residual are those of the norm
    module, then the block; past the GEMV's pairs, or without the option, the norm launches alone."""
    spec = dataclasses.replace(get_preset("qwen3-30b-a3b"), hidden_size=128, moe_intermediate_size=32, num_experts=8,
                               num_experts_per_tok=2)
    torch.manual_seed(0)
    moe, norm = SparseMoE(spec), RMSNorm(128, 1e-6)
    for param in list(moe.parameters()) + [norm.weight]:
        param.data.normal_(0.5 if param is norm.weight else 0.0, 0.05)
    sublayer_out, residual = torch.randn(2, 1, 128)
    fused, separate = (KernelChoice(triton=True, options=KernelOptions(moe_norm_router=on)) for on in (True, False))
    moe.kernels, norm.kernels = fused, fused
    assert moe.fuses_norm(sublayer_out, norm)
    assert not moe.fuses_norm(torch.randn(GEMV_MAX_PAIRS, 128), norm)
    out, new_residual = moe.after_norm(sublayer_out, residual, norm)
    moe.kernels, norm.kernels = separate, separate
    assert not moe.fuses_norm(sublayer_out, norm)
    x, ref_residual = norm(sublayer_out, residual)
    assert torch.equal(new_residual, ref_residual)
    torch.testing.assert_close(out, moe(x))
