"""The torch (CPU) attention path against the plain references in ops/attention.py: decode
attention as matmuls over one gather, and the per-layer entry point with its per-step indices."""

from __future__ import annotations

import pytest
import torch

from goodserve.ops import attention
from goodserve.ops.kernel_choice import TORCH_KERNELS
from goodserve.ops.attention import (
    LayerKVCache, decode_attention_torch, paged_attention_reference, rotary_write_kv_torch,
)
from test_triton_attention import ROTARY, assert_close, make_batch

DECODE_LENGTHS = [(1, 1), (1, 17), (1, 64), (1, 150)]


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("dtype,kv_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.int8),
    (torch.bfloat16, torch.float8_e4m3fn),
])
def test_decode_attention_matches_reference(num_q_heads, num_kv_heads, dtype, kv_dtype):
    q, cache, meta = make_batch(DECODE_LENGTHS, num_q_heads, num_kv_heads, 32, dtype, kv_dtype, seed=4)
    out = decode_attention_torch(q, cache, meta, 0.3)
    assert out.dtype == dtype
    assert_close(out, paged_attention_reference(q, cache, meta, 0.3), dtype)


def test_decode_attention_of_one_sequence_matches_reference():
    q, cache, meta = make_batch([(1, 77)], 9, 3, 64, torch.float32, torch.float32, seed=5)
    assert_close(decode_attention_torch(q, cache, meta, 0.125), paged_attention_reference(q, cache, meta, 0.125),
                 torch.float32)


@pytest.mark.parametrize("lengths", [[(1, 20), (1, 9)], [(4, 9), (1, 20), (3, 3)]])  # decode; mixed prefill
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_layer_entry_point_matches_rotary_write_and_reference_attention(lengths, kv_dtype):
    q, cache, meta = make_batch(lengths, 6, 2, 24, torch.float32, kv_dtype, seed=6)
    num_tokens = q.shape[0]
    k, v = torch.randn(2, num_tokens, 2, 24, generator=torch.Generator().manual_seed(7))
    positions = meta.seq_lens.repeat_interleave(torch.tensor(meta.query_lens_host)) - 1  # last ones
    positions -= torch.cat([torch.arange(n - 1, -1, -1) for n in meta.query_lens_host])
    clone = lambda c: LayerKVCache(*(t.clone() if t is not None else None for t in (c.k, c.v, c.k_scale, c.v_scale)))  # noqa: E731
    ref_q, ref_cache = q.clone(), clone(cache)
    rotary_write_kv_torch(ref_q, k, v, positions, ROTARY, ref_cache, meta.slot_mapping)
    expected = paged_attention_reference(ref_q, ref_cache, meta, 0.25)
    out = attention.attention(q, k, v, positions, ROTARY, cache, meta.for_new_step(), 0.25, TORCH_KERNELS)
    assert_close(out, expected, torch.float32)
    for pool, ref_pool in ((cache.k, ref_cache.k), (cache.v, ref_cache.v)):
        torch.testing.assert_close(pool.float(), ref_pool.float(), rtol=1e-5, atol=1e-5 if kv_dtype != torch.int8 else 1)


def test_padding_slots_are_not_written():
    q, cache, meta = make_batch([(1, 5), (1, 9)], 2, 2, 24, torch.float32, torch.float32, seed=8)
    meta.slot_mapping = torch.tensor([-1, int(meta.slot_mapping[1])], dtype=torch.int32)
    before = cache.k.clone()
    k, v = torch.ones(2, 2, 2, 24)
    attention.attention(q, k, v, torch.tensor([4, 8]), ROTARY, cache, meta.for_new_step(), 0.25, TORCH_KERNELS)
    changed = (cache.k != before).any(dim=(-1, -2)).flatten().nonzero().flatten().tolist()
    assert changed == [int(meta.slot_mapping[1])]
