"""The q/k RMSNorm (Qwen3; Gemma 3 with its 1 + weight) inside the Triton RoPE + cache-write and
decode attention kernels, under TRITON_INTERPRET=1, against transformers' own norm modules followed
by the plain-torch RoPE and cache write; and attention()'s dispatch of it on every path."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from goodserve.config import KernelOptions
from goodserve.ops import attention, norm, triton_ops
from goodserve.ops.attention import paged_attention_reference, write_kv_torch
from goodserve.ops.kernel_choice import TORCH_KERNELS
from goodserve.ops.norm import QKNorm
from goodserve.ops.rotary import apply_rotary_torch
from test_triton_attention import (  # noqa: F401 (kernels: a fixture)
    ROTARY, TRITON, assert_close, copied, decode_step, dequantized, fused_qkv, kernels, make_batch, make_cache,
)

EPS = 1e-6
HEAD_DIM = 24


def make_qk_norm(head_dim: int, dtype: torch.dtype, weight_offset: float, seed: int = 0) -> QKNorm:
    """Weights far from 1 (Qwen3's multiply; Gemma's offset ones sit near 0)."""
    gen = torch.Generator().manual_seed(seed)
    q_weight, k_weight = (torch.randn(head_dim, generator=gen) * 0.5 + (0.0 if weight_offset else 1.0)
                          for _ in range(2))
    return QKNorm(q_weight.to(dtype), k_weight.to(dtype), EPS, weight_offset)


def transformers_norm(x: torch.Tensor, weight: torch.Tensor, weight_offset: float) -> torch.Tensor:
    """transformers' own module: Qwen3's RMSNorm, or Gemma 3's (1 + weight) one."""
    module = (Gemma3RMSNorm if weight_offset else Qwen3RMSNorm)(x.shape[-1], eps=EPS).to(weight.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        return module(x)


def reference(q, k, v, positions, rotary, cache, slots, qk_norm: QKNorm) -> torch.Tensor:
    """q_norm / k_norm, then RoPE, then the cache write: returns the normed and rotated q."""
    q = transformers_norm(q, qk_norm.q_weight, qk_norm.weight_offset)
    k = transformers_norm(k, qk_norm.k_weight, qk_norm.weight_offset)
    rotated_q, rotated_k = apply_rotary_torch(q, k, positions, rotary)
    write_kv_torch(rotated_k, v, cache, slots)
    return rotated_q


def scaled_heads(x: torch.Tensor) -> torch.Tensor:
    """Heads of very different sizes, so a norm over the wrong span shows."""
    return x * torch.logspace(-1, 1, x.shape[1], dtype=torch.float32).to(x.dtype)[None, :, None]


@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype,kv_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.int8),
    (torch.bfloat16, torch.float8_e4m3fn),
])
def test_rotary_write_kv_norms_q_and_k_as_transformers(kernels, dtype, kv_dtype, weight_offset):
    q, k, v = fused_qkv(6, 5, 3, HEAD_DIM, dtype)
    q.copy_(scaled_heads(q))
    k.copy_(scaled_heads(k))
    qk_norm = make_qk_norm(HEAD_DIM, dtype, weight_offset)
    positions = torch.tensor([0, 1, 2, 40, 63, 7])
    slots = torch.tensor([3, -1, 40, 17, -1, 0], dtype=torch.int32)
    ours, ref = make_cache(4, 3, HEAD_DIM, kv_dtype), make_cache(4, 3, HEAD_DIM, kv_dtype)
    k_before, v_before = k.clone(), v.clone()
    ref_q = reference(q, k, v, positions, ROTARY, ref, slots, qk_norm)
    kernels.triton_rotary_write_kv(q, k, v, positions, ROTARY, ours, slots, qk_norm=qk_norm)
    assert torch.equal(k, k_before) and torch.equal(v, v_before)  # only q is changed in place
    assert_close(q, ref_q, dtype)
    if kv_dtype == torch.float8_e4m3fn:  # the interpreter's fp8 rounding (test_triton_attention.py)
        for pool, ref_pool in ((ours.k, ref.k), (ours.v, ref.v)):
            assert (pool.view(torch.uint8) != ref_pool.view(torch.uint8)).float().mean() < 0.03
    else:  # bf16 one step apart at most: the interpreter truncates where torch rounds
        tol = 3e-2 if kv_dtype == torch.bfloat16 else 1e-5
        for pool, scale, ref_pool, ref_scale in ((ours.k, ours.k_scale, ref.k, ref.k_scale),
                                                 (ours.v, ours.v_scale, ref.v, ref.v_scale)):
            torch.testing.assert_close(dequantized(pool, scale), dequantized(ref_pool, ref_scale), atol=tol, rtol=tol)
    assert ours.k.view(-1, 3, HEAD_DIM)[[1, 2, 4, 5]].float().abs().sum() == 0  # padding rows not written


@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            (torch.float32, torch.int8)])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_with_fused_qk_norm_matches_the_reference(kernels, dtype, kv_dtype, weight_offset, num_splits):
    """Norm, RoPE and the cache write inside decode attention: the output and cache of the reference
    (norm, RoPE, write, attention), and of the RoPE kernel followed by plain decode; q left as it came."""
    q, k, v, cache, meta, tables, seq_lens, positions, rotary, slots = decode_step(dtype, kv_dtype)
    qk_norm = make_qk_norm(HEAD_DIM, dtype, weight_offset, seed=1)
    fused_cache, two_kernel_cache, reference_cache, q_before = copied(cache), copied(cache), copied(cache), q.clone()
    out = kernels.triton_decode_attention(q, fused_cache, tables, seq_lens, 0.3, num_splits,
                                          new_tokens=kernels.NewTokens(k, v, positions, rotary, slots, qk_norm))
    assert torch.equal(q, q_before)
    prepared = q.clone()
    kernels.triton_rotary_write_kv(prepared, k, v, positions, rotary, two_kernel_cache, slots, qk_norm=qk_norm)
    expected = kernels.triton_decode_attention(prepared, two_kernel_cache, tables, seq_lens, 0.3, num_splits)
    assert_close(out, expected, dtype)
    reference_q = reference(q, k, v, positions, rotary, reference_cache, slots, qk_norm)
    assert_close(out[:-1], paged_attention_reference(reference_q[:-1], reference_cache, meta, 0.3), dtype)
    for ours, theirs in ((fused_cache.k, reference_cache.k), (fused_cache.v, reference_cache.v)):
        assert_close(ours.float(), theirs.float(), dtype)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # the padding row


FUSED = replace(TRITON, options=KernelOptions(fuse_rotary_into_decode_attention=True))
SEPARATE = replace(TRITON, options=KernelOptions(fuse_rotary_into_decode_attention=False))


@pytest.mark.parametrize("lengths", [[(1, 9), (1, 20)], [(4, 9), (1, 20)]], ids=["decode", "prefill"])
@pytest.mark.parametrize("kernel_choice", [FUSED, SEPARATE, TORCH_KERNELS], ids=["fused", "separate", "torch"])
def test_attention_applies_the_qk_norm_on_every_path(kernels, lengths, kernel_choice):
    """attention() with a qk_norm gives the reference's output and cache whichever kernels run it (the
    torch path's float32 norm is the native CPU kernel's)."""
    _, cache, meta = make_batch(lengths, 4, 2, HEAD_DIM, torch.float32, torch.float32, seed=3)
    q, k, v = fused_qkv(meta.slot_mapping.shape[0], 4, 2, HEAD_DIM, torch.float32, seed=4)
    positions = torch.cat([torch.arange(s - n, s) for n, s in lengths])
    qk_norm = make_qk_norm(HEAD_DIM, torch.float32, 0.0, seed=2)
    reference_cache = copied(cache)
    out = attention.attention(q.clone(), k, v, positions, ROTARY, cache, meta.for_new_step(), 0.25, kernel_choice,
                              qk_norm=qk_norm)
    reference_q = reference(q, k, v, positions, ROTARY, reference_cache, meta.slot_mapping, qk_norm)
    assert_close(out, paged_attention_reference(reference_q, reference_cache, meta, 0.25), torch.float32)
    assert_close(cache.k, reference_cache.k, torch.float32)
    assert torch.equal(cache.v, reference_cache.v)


@pytest.mark.parametrize("lengths", [[(1, 9), (1, 20)], [(4, 9), (1, 20)]], ids=["decode", "prefill"])
@pytest.mark.parametrize("kernel_choice", [FUSED, SEPARATE], ids=["fused", "separate"])
def test_triton_path_gives_the_qk_norm_no_launch_of_its_own(kernels, monkeypatch, lengths, kernel_choice):
    def separate_norm(*args, **kwargs):
        raise AssertionError("the q/k norm ran as a kernel of its own")

    monkeypatch.setattr(norm, "rms_norm", separate_norm)
    monkeypatch.setattr(triton_ops, "triton_rms_norm", separate_norm)
    _, cache, meta = make_batch(lengths, 4, 2, HEAD_DIM, torch.float32, torch.float32, seed=3)
    q, k, v = fused_qkv(meta.slot_mapping.shape[0], 4, 2, HEAD_DIM, torch.float32, seed=4)
    positions = torch.cat([torch.arange(s - n, s) for n, s in lengths])
    attention.attention(q, k, v, positions, ROTARY, cache, meta.for_new_step(), 0.25, kernel_choice,
                        qk_norm=make_qk_norm(HEAD_DIM, torch.float32, 1.0))
