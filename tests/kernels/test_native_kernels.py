"""The native CPU kernels (src/goodserve/native/) against their plain-torch references: the int4
and Q8_0 GEMVs against a matmul on the dequantized weight, the layer ops against ops/norm.py,
ops/activation.py and the reference RoPE + cache write, decode attention against
paged_attention_reference. Odd sizes exercise the kernels' tails; the build is checked to have
happened (a silent fallback would compare torch with torch)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from goodserve.native import build, layer_ops
from goodserve.native.int4_gemv import (Int4Layout, half_scales_available, int8_activation_matmul_reference,
                                        int8_dot_available)
from goodserve.native.q8_gemv import Q8Layout
from goodserve.ops.activation import silu_and_mul_torch
from goodserve.ops.attention import LayerKVCache, paged_attention_reference, rotary_write_kv_torch
from goodserve.ops.norm import add_rms_norm_torch, rms_norm_torch
from goodserve.ops.rotary import cos_sin_cache
from goodserve.quant.linear import Int4Linear
from test_triton_attention import make_batch


def test_library_builds_here():
    assert build.library() is not None  # CI and development machines have a compiler


def test_missing_compiler_falls_back_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setattr(build, "compiler", lambda: None)
    build.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="goodserve.native"):
            assert build.library() is None
            assert build.library() is None
        assert [r.getMessage() for r in caplog.records] == [
            "native CPU kernels unavailable, using the torch paths: no C++ compiler found (set CXX)"]
        assert not layer_ops.usable(torch.zeros(1))
    finally:
        build.library.cache_clear()


def test_a_failed_build_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("GOODSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "FLAGS", (*build.FLAGS, "-fno-such-flag"))
    build.library.cache_clear()
    try:
        assert build.library() is None
    finally:
        build.library.cache_clear()


def int4_layer(n: int, k: int, group_size: int, seed: int) -> Int4Linear:
    torch.manual_seed(seed)
    return Int4Linear.from_linear(torch.nn.Linear(k, n, bias=False), group_size)


@pytest.mark.parametrize("n,k,group_size", [(1, 32, 32), (5, 96, 32), (17, 128, 64), (64, 576, 32),
                                            (30, 384, 128), (4, 256, 64)])
@pytest.mark.parametrize("m", [1, 3, 4, 9])
@pytest.mark.parametrize("half", [False, True])  # float16 scales and zeros (GGUF's) take the half layout
def test_int4_gemv_matches_the_dequantized_matmul(n, k, group_size, m, half):
    layer = int4_layer(n, k, group_size, seed=n + k + m)
    if half:
        layer.scales.copy_(layer.scales.half().float())
        layer.zeros.copy_(layer.zeros.half().float())
    x = torch.randn(m, k + 7)[:, 3 : 3 + k]  # strided rows
    layout = Int4Layout.from_codes(layer.qweight, layer.scales, layer.zeros, group_size)
    assert layout.half_scales == (half and half_scales_available())
    got = layout.matmul(x)
    want = x @ layer.dequantize(torch.float32).T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("n,k", [(1, 32), (5, 96), (17, 128), (64, 576)])
@pytest.mark.parametrize("m", [1, 3, 4, 9])
def test_q8_gemv_matches_the_dequantized_matmul(n, k, m):
    """Q8_0 codes (int8, a float16 scale per 32 inputs, the extremes -128 and 127 included) against
    float64 torch on the dequantized weight."""
    generator = torch.Generator().manual_seed(n + k + m)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
    codes[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)
    scales = torch.rand(n, k // 32, generator=generator).half().float()
    x = torch.randn(m, k + 7, generator=generator)[:, 3 : 3 + k]  # strided rows
    got = Q8Layout.from_codes(codes, scales).matmul(x)
    weight = (codes.double().view(n, -1, 32) * scales.double()[..., None]).view(n, k)
    want = (x.double() @ weight.T).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.skipif(not int8_dot_available(), reason="no int8-activation path in this build (neither AVX2 nor AVX-512BW)")
@pytest.mark.parametrize("n,k,group_size", [(1, 32, 32), (5, 96, 32), (17, 128, 64), (64, 576, 32),
                                            (30, 384, 128), (4, 256, 64)])
@pytest.mark.parametrize("m", [1, 3, 4, 9])
@pytest.mark.parametrize("half", [False, True])
def test_int8_activation_gemv_matches_its_torch_reference(n, k, group_size, m, half):
    """The integer-dot path against plain torch doing the same activation quantization (float64):
    the integer dots are exact, so only float32 accumulation order differs. Some rows hold zeros
    (a zero block has scale 0) and large values, for the rounding and the block maxima."""
    layer = int4_layer(n, k, group_size, seed=n + k + m)
    if half:
        layer.scales.copy_(layer.scales.half().float())
        layer.zeros.copy_(layer.zeros.half().float())
    x = torch.randn(m, k + 7)[:, 3 : 3 + k]  # strided rows
    x[0, :32] = 0
    x[-1, 5] = 40.0
    layout = Int4Layout.from_codes(layer.qweight, layer.scales, layer.zeros, group_size)
    layout.int8_activations = True
    got = layout.matmul(x)
    want = int8_activation_matmul_reference(x, layer.dequantize(torch.float32))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # And within the rounding bound of the float product: each activation moves at most half its
    # block's step (max |x| / 127), so a dot moves at most sum over blocks of step / 2 * sum |w|.
    w = layer.dequantize(torch.float32)
    error = (layout.matmul(x) - x @ w.T).abs()
    steps = x.reshape(m, -1, 32).abs().amax(-1) / 127
    bound = (steps / 2) @ w.abs().reshape(n, -1, 32).sum(-1).T
    assert (error <= bound * 1.001 + 1e-5).all()


@pytest.mark.skipif(not int8_dot_available(), reason="no int8-activation path in this build (neither AVX2 nor AVX-512BW)")
def test_int8_activation_rows_do_not_depend_on_the_batch():
    """A decode row (native kernel) and the same row in a prefill-sized call (dequantize + dense
    matmul) quantize alike, so a request's tokens do not depend on its batch."""
    layer = int4_layer(48, 256, 32, seed=3)
    layer.int8_activations = True
    x = torch.randn(100, 256)
    alone, batched = layer(x[:1]), layer(x)[:1]
    torch.testing.assert_close(alone, batched, rtol=1e-5, atol=1e-5 * batched.abs().max().item())


def test_int4_linear_sends_decode_rows_to_the_native_kernel():
    layer = int4_layer(48, 64, 32, seed=1)
    assert layer._native_kernel() and layer.cpu_packed_max_m == 64
    x = torch.randn(2, 64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.dequantize()), rtol=1e-5, atol=1e-5)
    assert layer._native_layout is not None
    bf16 = layer(x.bfloat16())  # float32 inside, cast back
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), F.linear(x.bfloat16().float(), layer.dequantize()), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("hidden", [16, 40, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch(hidden, with_residual):
    x, residual, weight = torch.randn(3, 5, hidden), torch.randn(3, 5, hidden), torch.randn(hidden)
    out, summed = layer_ops.add_rms_norm(x, residual if with_residual else None, weight, 1e-5)
    if with_residual:
        want, want_sum = add_rms_norm_torch(x, residual, weight, 1e-5)
        torch.testing.assert_close(summed, want_sum)
    else:
        want = rms_norm_torch(x, weight, 1e-5)
        assert summed is None
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("inter", [8, 37, 1536])
def test_silu_and_mul_matches_torch(inter):
    gate_up = torch.randn(4, 2 * inter) * 8
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's underflow and overflow ends
    torch.testing.assert_close(layer_ops.silu_and_mul(gate_up), silu_and_mul_torch(gate_up), rtol=2e-6, atol=1e-6)


def test_rope_write_kv_matches_the_reference():
    heads, kv_heads, head_dim, tokens = 6, 2, 32, 5
    table = cos_sin_cache(head_dim, 64, 10000.0, None)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)  # q, k, v are strided views
    q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                                  kv_heads * head_dim], dim=-1))
    positions = torch.tensor([0, 7, 8, 33, 63], dtype=torch.int32)
    slots = torch.tensor([3, -1, 12, 0, 9], dtype=torch.int32)
    pools = [torch.zeros(4, 4, kv_heads, head_dim) for _ in range(2)]
    ref_q, ref = q.clone(), LayerKVCache(*(p.clone() for p in pools))
    rotary_write_kv_torch(ref_q, k, v, positions.long(), table, ref, slots)
    layer_ops.rope_write_kv(q, k, v, positions, table, *pools, slots)
    torch.testing.assert_close(q, ref_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pools[0], ref.k, rtol=1e-6, atol=1e-6)
    assert torch.equal(pools[1], ref.v)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("lengths", [[(1, 1)], [(1, 77)], [(1, 1), (1, 17), (1, 64), (1, 150)]])
@pytest.mark.parametrize("column_major", [False, True])
def test_decode_attention_matches_the_reference(num_q_heads, num_kv_heads, lengths, column_major):
    q, cache, meta = make_batch(lengths, num_q_heads, num_kv_heads, 32, torch.float32, torch.float32, seed=9)
    tables = meta.block_tables.t().contiguous().t() if column_major else meta.block_tables
    got = layer_ops.decode_attention(q, cache.k, cache.v, tables, meta.seq_lens, 0.2)
    torch.testing.assert_close(got, paged_attention_reference(q, cache, meta, 0.2), rtol=1e-5, atol=1e-5)
