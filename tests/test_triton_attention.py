"""Triton paged-attention kernels under TRITON_INTERPRET=1 against the plain-torch reference.

Triton reads TRITON_INTERPRET when a kernel is decorated, so the fixture below imports (or reloads)
the kernel module with the variable set, and reloads it again without it afterwards: the rest of a
one-process suite keeps compiled kernels.

Interpreter limits: it rounds float32 -> bf16/fp8 casts by truncation (bf16 outputs are compared
loosely, fp8 writes within one fp8 step), and multiplies bf16 dot operands as raw bits, so the
kernels upcast dots to float32 on CPU tensors: the bf16 tensor-core dot is checked on the GPU only
(benchmarks/gpu_kernels.py).
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from goodserve.ops import attention
from goodserve.ops.attention import (
    AttentionMetadata, LayerKVCache, paged_attention_reference, quantize_int8_per_head, write_kv_torch,
)

KERNEL_MODULE = "goodserve.ops.triton_attention"
BLOCK_SIZE = 16


def _import_with_interpret(name: str, interpret: str | None):
    old = os.environ.pop("TRITON_INTERPRET", None)
    if interpret is not None:
        os.environ["TRITON_INTERPRET"] = interpret
    module = sys.modules.get(name)
    module = importlib.reload(module) if module else importlib.import_module(name)
    return module, old


@pytest.fixture(scope="module")
def kernels():
    module, old = _import_with_interpret(KERNEL_MODULE, "1")
    yield module
    _import_with_interpret(KERNEL_MODULE, old)
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)


def make_cache(num_blocks, num_kv_heads, head_dim, kv_dtype, block_size=BLOCK_SIZE) -> LayerKVCache:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k, v = torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)
    if kv_dtype != torch.int8:
        return LayerKVCache(k, v)
    return LayerKVCache(k, v, torch.zeros(shape[:3]), torch.zeros(shape[:3]))


def make_batch(lengths, num_q_heads, num_kv_heads, head_dim, dtype, kv_dtype, seed=0):
    """lengths: [(q_len, seq_len)]. Returns q, a cache holding every sequence's full context, meta.

    Blocks are handed out in a shuffled order so block tables are not contiguous.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-seq_len // BLOCK_SIZE) for _, seq_len in lengths]
    free = torch.randperm(sum(blocks_needed) + 3, generator=gen).tolist()
    cache = make_cache(len(free), num_kv_heads, head_dim, kv_dtype)
    block_tables = torch.zeros(len(lengths), max(blocks_needed) + 1, dtype=torch.int32)
    new_slots = []
    for i, ((q_len, seq_len), n) in enumerate(zip(lengths, blocks_needed)):
        block_tables[i, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
        pos = torch.arange(seq_len)
        slots = block_tables[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        write_kv_torch(k, v, cache, slots)
        new_slots.append(slots[seq_len - q_len:])
    q_lens = [q_len for q_len, _ in lengths]
    seq_lens = [seq_len for _, seq_len in lengths]
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(new_slots),
        query_start_loc=torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=q_lens,
        seq_lens_host=seq_lens,
    )
    return q, cache, meta


def assert_close(out, ref, dtype):
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: one output rounding step plus truncation
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


DECODE_LENGTHS = [(1, 1), (1, 17), (1, 64), (1, 150)]  # one partial block, block multiples, many tiles


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (8, 2)])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_matches_reference(kernels, num_q_heads, num_kv_heads, num_splits):
    q, cache, meta = make_batch(DECODE_LENGTHS, num_q_heads, num_kv_heads, 32, torch.float32, torch.float32)
    out = kernels.triton_decode_attention(q, cache, meta.block_tables, meta.seq_lens, 0.3, num_splits)
    assert_close(out, paged_attention_reference(q, cache, meta, 0.3), torch.float32)


@pytest.mark.parametrize("dtype,kv_dtype", [
    (torch.bfloat16, torch.bfloat16), (torch.float32, torch.int8), (torch.bfloat16, torch.float8_e4m3fn),
])
def test_decode_cache_dtypes(kernels, dtype, kv_dtype):
    q, cache, meta = make_batch(DECODE_LENGTHS, 6, 2, 32, dtype, kv_dtype, seed=1)
    out = kernels.triton_decode_attention(q, cache, meta.block_tables, meta.seq_lens, 0.2, num_splits=2)
    assert out.dtype == dtype
    assert_close(out, paged_attention_reference(q, cache, meta, 0.2), dtype)


# Prefill from empty, decodes, a chunk on top of cached context, lengths off block boundaries.
MIXED_LENGTHS = [(5, 5), (1, 30), (20, 37), (3, 3), (1, 1)]


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (6, 2)])
def test_prefill_mixed_batch_matches_reference(kernels, num_q_heads, num_kv_heads):
    q, cache, meta = make_batch(MIXED_LENGTHS, num_q_heads, num_kv_heads, 32, torch.float32, torch.float32)
    out = kernels.triton_prefill_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.25)
    assert_close(out, paged_attention_reference(q, cache, meta, 0.25), torch.float32)


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.int8)])
def test_prefill_cache_dtypes(kernels, dtype, kv_dtype):
    q, cache, meta = make_batch([(18, 18), (4, 21)], 4, 2, 16, dtype, kv_dtype, seed=2)
    out = kernels.triton_prefill_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.25)
    assert_close(out, paged_attention_reference(q, cache, meta, 0.25), dtype)


def test_write_kv_skips_padding_and_matches_reference(kernels):
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        k, v = torch.randn(2, 6, 3, 24).to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
        slots = torch.tensor([3, -1, 40, 17, -1, 0])
        ours, ref = make_cache(4, 3, 24, dtype), make_cache(4, 3, 24, dtype)
        kernels.triton_write_kv(k, v, ours, slots)
        write_kv_torch(k, v, ref, slots)
        assert torch.equal(ours.k, ref.k) and torch.equal(ours.v, ref.v), dtype
        if dtype == torch.int8:
            assert torch.equal(ours.k_scale, ref.k_scale) and torch.equal(ours.v_scale, ref.v_scale)
            values, scale = quantize_int8_per_head(k)  # independent of write_kv_torch
            assert torch.equal(ours.k.view(-1, 3, 24)[3], values[0]) and torch.equal(ours.k_scale.view(-1, 3)[3], scale[0])
        assert ours.k.view(-1, 3, 24)[[1, 2, 4, 5]].abs().sum() == 0  # untouched slots stay empty


def test_write_kv_fp8_rounds_like_torch(kernels):
    k, v = torch.randn(2, 5, 2, 16)
    slots = torch.tensor([7, -1, 1, 30, 12])
    ours, ref = make_cache(2, 2, 16, torch.float8_e4m3fn), make_cache(2, 2, 16, torch.float8_e4m3fn)
    kernels.triton_write_kv(k, v, ours, slots)
    write_kv_torch(k, v, ref, slots)
    # The interpreter's fp8 rounding misses values that round up into the next binade (about 1 in
    # 100 here); on a GPU the cast is exact. Everything else must match bit for bit.
    for pool, ref_pool in ((ours.k, ref.k), (ours.v, ref.v)):
        mismatched = pool.view(torch.uint8) != ref_pool.view(torch.uint8)
        assert mismatched.float().mean() < 0.03
    assert ours.v.float().view(-1, 2, 16)[[0, 2, 3]].abs().sum() == 0


def test_public_dispatch_takes_triton_when_forced(kernels):
    q, cache, meta = make_batch([(4, 9), (1, 20)], 4, 2, 16, torch.float32, torch.float32, seed=3)
    k, v = torch.randn(2, 5, 2, 16)
    ref_cache = LayerKVCache(cache.k.clone(), cache.v.clone())
    attention.set_attention_backend("triton")
    try:
        attention.write_kv(k, v, cache, meta.slot_mapping)
        out = attention.paged_attention(q, cache, meta, 0.25)
    finally:
        attention.set_attention_backend("auto")
    write_kv_torch(k, v, ref_cache, meta.slot_mapping)
    assert torch.equal(cache.k, ref_cache.k)
    assert_close(out, paged_attention_reference(q, ref_cache, meta, 0.25), torch.float32)


def test_backend_names_are_checked():
    with pytest.raises(ValueError, match="attention_backend"):
        attention.set_attention_backend("cuda")
    assert attention.get_attention_backend() == "auto"
    assert not attention.use_triton(torch.zeros(1))  # auto on a CPU tensor: the torch path
