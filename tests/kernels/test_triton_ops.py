"""Fused Triton norm / activation / argmax kernels under TRITON_INTERPRET=1 against the torch references.

The fixture imports the kernel module with TRITON_INTERPRET=1 (Triton reads it when kernels are
decorated) and reloads it without the variable afterwards, so the rest of a one-process suite is
unaffected. The interpreter truncates float32 -> bf16 casts where a GPU rounds to nearest, so bf16
results are compared to within one bf16 step.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from goodserve.config import KernelOptions
from goodserve.ops.activation import silu_and_mul, silu_and_mul_torch
from goodserve.ops.norm import (
    HeadNorm, add_rms_norm, add_rms_norm_torch, offset_rms_norm_torch, qk_rms_norm, rms_norm, rms_norm_torch,
)
from goodserve.ops.kernel_choice import TORCH_KERNELS, KernelChoice, choose_kernels
from goodserve.ops.sampler import argmax

KERNEL_MODULE = "goodserve.ops.triton_ops"
DTYPES = [torch.float32, torch.bfloat16]


def _import_with_interpret(name: str, interpret: str | None):
    os.environ.pop("TRITON_INTERPRET", None)
    if interpret is not None:
        os.environ["TRITON_INTERPRET"] = interpret
    module = sys.modules.get(name)
    return importlib.reload(module) if module else importlib.import_module(name)


@pytest.fixture(scope="module")
def kernels():
    old = os.environ.get("TRITON_INTERPRET")
    yield _import_with_interpret(KERNEL_MODULE, "1")
    _import_with_interpret(KERNEL_MODULE, old)


def assert_close(out, ref):
    if ref.dtype == torch.bfloat16:
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1.6e-2)
    else:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(kernels, dtype):
    x = torch.randn(5, 96).to(dtype)  # hidden not a power of two
    weight = (1 + 0.1 * torch.randn(96)).to(dtype)
    assert_close(kernels.triton_rms_norm(x, weight, 1e-5), rms_norm_torch(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_returns_normed_and_new_residual(kernels, dtype):
    x, residual = torch.randn(2, 4, 64).to(dtype)
    weight = (1 + 0.1 * torch.randn(64)).to(dtype)
    before = residual.clone()
    normed, new_residual = kernels.triton_add_rms_norm(x, residual, weight, 1e-6)
    ref_normed, ref_residual = add_rms_norm_torch(x, residual, weight, 1e-6)
    assert torch.equal(residual, before)  # out of place, like the reference
    assert_close(new_residual, ref_residual)
    assert_close(normed, ref_normed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_scales_by_one_plus_weight(kernels, dtype):
    """Gemma's norm (weight_offset 1): Triton's, and the CPU's native one in float32, against the
    float32 reference; with and without the residual add."""
    x, residual = torch.randn(2, 5, 96).to(dtype)
    weight = (0.1 * torch.randn(96)).to(dtype)  # stored as Gemma's checkpoints store it: scale - 1
    ref_residual = x + residual
    ref = offset_rms_norm_torch(ref_residual, weight, 1e-6, 1.0)
    assert not torch.allclose(ref.float(), rms_norm_torch(ref_residual, weight, 1e-6).float(), atol=0.1)
    assert_close(kernels.triton_rms_norm(ref_residual, weight, 1e-6, weight_offset=1.0), ref)
    normed, new_residual = kernels.triton_add_rms_norm(x, residual, weight, 1e-6, weight_offset=1.0)
    assert_close(new_residual, ref_residual)
    assert_close(normed, ref)
    if dtype == torch.float32:
        normed, new_residual = add_rms_norm(x, residual, weight, 1e-6, TORCH_KERNELS, 1.0)
        assert_close(normed, ref)
        assert_close(rms_norm(ref_residual, weight, 1e-6, TORCH_KERNELS, 1.0), ref)


@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_rms_norm_in_place_norms_each_q_and_k_head(kernels, dtype, weight_offset):
    """Qwen3's (and Gemma 3's, offset 1) q/k norms in one in-place launch over the qkv rows, against
    the reference applied to each head of q and of k; v's columns stay as they were."""
    heads, kv_heads, head_dim, eps = 4, 2, 48, 1e-6  # head_dim not a power of two
    qkv = (3 * torch.randn(5, (heads + 2 * kv_heads) * head_dim)).to(dtype)
    q_weight, k_weight = ((1 + 0.3 * torch.randn(head_dim)).to(dtype) for _ in range(2))
    q_ref, k_ref, v_ref = qkv.clone().split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    norm = rms_norm_torch if not weight_offset else lambda x, w, e: offset_rms_norm_torch(x, w, e, weight_offset)
    q_ref = norm(q_ref.reshape(5, heads, head_dim), q_weight, eps)
    k_ref = norm(k_ref.reshape(5, kv_heads, head_dim), k_weight, eps)
    kernels.triton_qk_rms_norm_(qkv, q_weight, k_weight, heads, kv_heads, head_dim, eps, weight_offset=weight_offset)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    assert_close(q.reshape(5, heads, head_dim), q_ref)
    assert_close(k.reshape(5, kv_heads, head_dim), k_ref)
    assert torch.equal(v, v_ref)


def test_qk_rms_norm_gives_the_same_views_on_either_path(kernels):
    """ops.norm.qk_rms_norm: q [T, Hq, D], k and v [T, Hkv, D] whether Triton normed the rows in place
    or the torch path normed the split views."""
    qkv = torch.randn(3, (4 + 2 * 2) * 32)
    norm = HeadNorm(torch.rand(32), torch.rand(32), num_q_heads=4, num_kv_heads=2, head_dim=32, eps=1e-6)
    torch_q, torch_k, torch_v = qk_rms_norm(qkv.clone(), norm, TORCH_KERNELS)
    q, k, v = qk_rms_norm(qkv, norm, KernelChoice(triton=True))
    assert q.shape == torch_q.shape == (3, 4, 32) and k.shape == v.shape == (3, 2, 32)
    for got, want in ((q, torch_q), (k, torch_k), (v, torch_v)):
        assert_close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(kernels, dtype):
    gate_up = (3 * torch.randn(2, 3, 2 * 80)).to(dtype)
    assert_close(kernels.triton_silu_and_mul(gate_up), silu_and_mul_torch(gate_up))


def test_argmax_takes_the_first_maximum_like_torch(kernels):
    x = torch.randn(4, 5000)  # three chunks per row
    x[1, [100, 4000]] = 10.0  # a tie across chunks
    x[2, [2049, 2050]] = 10.0  # a tie within a chunk
    x[3] = float("-inf")  # nothing finite: index 0, as torch gives
    assert torch.equal(kernels.triton_argmax(x), x.argmax(dim=-1))
    assert torch.equal(kernels.triton_argmax(x[:, :300]), x[:, :300].argmax(dim=-1))  # strided rows, one chunk


def test_public_functions_dispatch_to_triton_when_chosen(kernels):
    x, residual = torch.randn(2, 3, 32)
    weight = torch.rand(32)
    triton = KernelChoice(triton=True)
    normed, new_residual = add_rms_norm(x, residual, weight, 1e-5, triton)
    activated = silu_and_mul(x, triton)
    tokens = argmax(x, triton)
    assert_close(normed, add_rms_norm_torch(x, residual, weight, 1e-5)[0])
    assert_close(new_residual, x + residual)
    assert_close(activated, silu_and_mul_torch(x))
    assert torch.equal(tokens, x.argmax(dim=-1))


def test_kernels_on_the_cpu_never_launch_with_pdl():
    """The interpreter has no grid dependencies: a CPU model's choice has PDL off, asked for or not."""
    cpu = torch.device("cpu")
    for pdl in (True, False):
        choice = choose_kernels("triton", KernelOptions(pdl=pdl), cpu)
        assert choice.triton and not choice.pdl
    assert not choose_kernels("auto", KernelOptions(), cpu).triton  # auto on the CPU: the torch path
