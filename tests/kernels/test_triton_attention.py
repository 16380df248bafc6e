"""Triton paged-attention and RoPE + cache-write kernels under TRITON_INTERPRET=1 against the
plain-torch references.

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
from dataclasses import replace

import pytest
import torch

from goodserve.config import KernelOptions
from goodserve.ops import attention
from goodserve.ops.attention import (
    AttentionMetadata, LayerKVCache, paged_attention_reference, rotary_write_kv_torch, write_kv_torch,
)
from goodserve.ops.flash_prefill import flash_prefill
from goodserve.ops.kernel_choice import KernelChoice, choose_kernels
from goodserve.ops.rope_scaling import RopeScaling
from goodserve.ops.rotary import cos_sin_cache

KERNEL_MODULE = "goodserve.ops.triton_attention"
TRITON = KernelChoice(triton=True)
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


def column_major(block_tables: torch.Tensor) -> torch.Tensor:
    """The same table with the decode graphs' layout: block j of every sequence side by side."""
    return block_tables.t().contiguous().t()


def graph_shaped_batch(num_q_heads, num_kv_heads, seq_lens, capacity_blocks=40):
    """A decode batch as the engine's graphs see it: a table sized for the longest possible context,
    column-major, and a padding row of length 0 (the last)."""
    q, cache, meta = make_batch([(1, n) for n in seq_lens], num_q_heads, num_kv_heads, 32, torch.float32,
                                torch.float32, seed=4)
    tables = torch.zeros(len(seq_lens) + 1, capacity_blocks, dtype=torch.int32)
    tables[: len(seq_lens), : meta.block_tables.shape[1]] = meta.block_tables
    q = torch.cat([q, torch.randn(1, *q.shape[1:])])
    return q, cache, meta, column_major(tables), torch.tensor(seq_lens + [0], dtype=torch.int32)


@pytest.mark.parametrize("tuning", [
    {"BLOCK_N": 16, "SPLIT_KEYS": 16},  # one tile per split
    {"BLOCK_N": 32, "SPLIT_KEYS": 16},  # tiles wider than splits (masked)
    {"BLOCK_N": 16, "SPLIT_KEYS": 48},  # several tiles per split
    {"BLOCK_N": 16, "SPLIT_KEYS": 16, "DIRECT_KEYS": 40},  # up to 40 keys in one split, several tiles
])
def test_decode_short_contexts_in_a_graph_sized_launch(kernels, tuning):
    """Splits sized for 640 keys on contexts of 1..150: one split used (direct write), several
    (merged by the last to arrive), empty splits, and a zero-length padding row (zeros)."""
    seq_lens = [1, 16, 17, 40, 150]
    q, cache, meta, tables, lens = graph_shaped_batch(6, 2, seq_lens)  # GQA group of 3
    args = (q, cache, tables, lens, 0.3)
    out = kernels.triton_decode_attention(*args, num_splits=8, tuning=tuning)
    assert_close(out[:-1], paged_attention_reference(q[:-1], cache, meta, 0.3), torch.float32)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    assert kernels._arrival_counters(q.device, lens.shape[0] * 2).eq(0).all()  # ready for a replay
    assert torch.equal(kernels.triton_decode_attention(*args, num_splits=8, tuning=tuning), out)


# Prefill from empty, decodes, a chunk on top of cached context, lengths off block boundaries.
MIXED_LENGTHS = [(5, 5), (1, 30), (20, 37), (3, 3), (1, 1)]


@pytest.mark.parametrize("num_q_heads,num_kv_heads,layout", [(2, 2, "row-major"), (6, 2, "column-major")])
def test_prefill_mixed_batch_matches_reference(kernels, num_q_heads, num_kv_heads, layout):
    q, cache, meta = make_batch(MIXED_LENGTHS, num_q_heads, num_kv_heads, 32, torch.float32, torch.float32)
    tables = column_major(meta.block_tables) if layout == "column-major" else meta.block_tables
    out = kernels.triton_prefill_attention(q, cache, tables, meta.seq_lens, meta.query_start_loc, 0.25)
    assert_close(out, paged_attention_reference(q, cache, meta, 0.25), torch.float32)


# The windowed case is causal too (a window only drops keys further back): the fast tier takes it.
@pytest.mark.parametrize("window", [pytest.param(None, marks=pytest.mark.slow), 24])
def test_prefill_splits_a_blocks_keys_over_programs(kernels, window):
    """Each query block's keys over up to 4 programs of >= 16 keys (the interpreter's SPLIT_KEYS),
    merged by the last to finish, with rows that see no key of some split (causal, windowed); a
    second launch reuses the arrival counters the first left zeroed."""
    q, cache, meta = make_batch([(3, 70), (18, 60), (1, 50)], 6, 2, 32, torch.float32,
                                torch.float32, seed=5)
    ref = paged_attention_reference(q, cache, meta, 0.25, window)
    for _ in range(2):
        out = kernels.triton_prefill_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                               0.25, window=window, num_splits=4)
        assert_close(out, ref, torch.float32)


# Decodes first (one of them at an empty-ish context), then chunks and a decode the prefill kernel keeps.
LEADING_DECODES = [(1, 30), (1, 1), (1, 150), (20, 37), (5, 5), (1, 17)]


def test_prefill_leaves_leading_decodes_to_the_decode_kernel(kernels):
    q, cache, meta = make_batch(LEADING_DECODES, 6, 2, 32, torch.float32, torch.float32, seed=4)
    ref = paged_attention_reference(q, cache, meta, 0.25)
    out = torch.full_like(q, float("nan"))
    kernels.triton_prefill_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.25,
                                     first_seq=3, out=out)
    assert out[:3].isnan().all()  # not the prefill kernel's rows
    assert_close(out[3:], ref[3:], torch.float32)
    split = attention.paged_attention(q, cache, replace(meta, num_leading_decodes=3), 0.25, TRITON)
    assert_close(split, ref, torch.float32)


def test_decode_count_read_on_the_device(kernels):
    """A mixed graph's launches: the count of leading decodes is a device scalar, the decode grid
    covers every row and the prefill grid every sequence; each kernel writes only its own rows."""
    q, cache, meta = make_batch(LEADING_DECODES, 6, 2, 32, torch.float32, torch.float32, seed=4)
    ref = paged_attention_reference(q, cache, meta, 0.25)
    count = torch.tensor([3], dtype=torch.int32)
    rows = meta.seq_lens.shape[0]
    out = torch.full_like(q, float("nan"))
    kernels.triton_decode_attention(q[:rows], cache, meta.block_tables, meta.seq_lens, 0.25, num_splits=2,
                                    out=out[:rows], num_decodes=count)
    assert_close(out[:3], ref[:3], torch.float32)
    assert out[3:].isnan().all()
    # three sequences after the decodes; the grid is sized for four (a graph's bound is never tight)
    kernels.triton_prefill_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.25,
                                     first_seq=count, out=out, max_seqs=4)
    assert_close(out, ref, torch.float32)
    graphed = attention.paged_attention(q, cache, replace(meta, leading_decodes=count), 0.25, TRITON)
    assert_close(graphed, ref, torch.float32)


def test_flash_prefill_takes_the_last_queries_of_its_keys():
    """ops/flash_prefill.py's call (its lower-right causal mask, grouped heads, the layout) against the
    reference; on the CPU, SDPA computes it with the mask materialized (flash itself: tests/gpu)."""
    q, cache, meta = make_batch([(5, 37)], 6, 2, 32, torch.float32, torch.float32, seed=7)
    key, value = attention.gather_kv(cache, meta.block_tables[0, :3].long(), 37, torch.float32)
    assert_close(flash_prefill(q, key, value, 0.3), paged_attention_reference(q, cache, meta, 0.3), torch.float32)


def test_a_batch_split_between_flash_and_the_prefill_kernel(kernels):
    """Two chunks to flash (one on cached context), each run of sequences around them to the Triton
    kernel, the leading decodes already done: every row is the reference's."""
    q, cache, meta = make_batch([(1, 20), (1, 33), (7, 7), (24, 40), (5, 21), (18, 18)], 4, 2, 32, torch.float32,
                                torch.float32, seed=8)
    meta = replace(meta, num_leading_decodes=2)
    out = torch.full_like(q, float("nan"))
    out[:2] = kernels.triton_decode_attention(q[:2], cache, meta.block_tables[:2], meta.seq_lens[:2], 0.3)
    attention._prefill_with_flash(q, cache, meta, 0.3, [3, 5], out, pdl=False, splits=None)
    assert_close(out, paged_attention_reference(q, cache, meta, 0.3), torch.float32)


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.int8)])
def test_prefill_cache_dtypes(kernels, dtype, kv_dtype):
    q, cache, meta = make_batch([(18, 18), (4, 21)], 4, 2, 16, dtype, kv_dtype, seed=2)
    out = kernels.triton_prefill_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.25)
    assert_close(out, paged_attention_reference(q, cache, meta, 0.25), dtype)


ROTARY = cos_sin_cache(24, 64, 10000.0, RopeScaling(8.0, 1.0, 4.0, 16))


def dequantized(pool: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return pool.float() if scale is None else pool.float() * scale.unsqueeze(-1)


def fused_qkv(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, seed=0):
    """q, k, v as the model has them: strided views into one projection output."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return q.view(num_tokens, num_q_heads, head_dim), *(x.view(num_tokens, num_kv_heads, head_dim) for x in (k, v))


@pytest.mark.parametrize("dtype,kv_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.int8),
    (torch.bfloat16, torch.int8), (torch.float32, torch.float8_e4m3fn),
])
def test_rotary_write_kv_matches_reference(kernels, dtype, kv_dtype):
    q, k, v = fused_qkv(6, 5, 3, 24, dtype)  # head counts not powers of two
    positions = torch.tensor([0, 1, 2, 40, 63, 7])
    slots = torch.tensor([3, -1, 40, 17, -1, 0], dtype=torch.int32)  # -1: padding, not written
    ref_q, k_before, v_before = q.clone(), k.clone(), v.clone()
    ours, ref = make_cache(4, 3, 24, kv_dtype), make_cache(4, 3, 24, kv_dtype)
    kernels.triton_rotary_write_kv(q, k, v, positions, ROTARY, ours, slots)
    rotary_write_kv_torch(ref_q, k, v, positions, ROTARY, ref, slots)
    assert torch.equal(k, k_before) and torch.equal(v, v_before)  # only q is rotated in place
    assert_close(q, ref_q, dtype)
    if dtype == torch.float32 and kv_dtype in (torch.float32, torch.int8):  # no float32 -> 16-bit casts
        assert torch.equal(q, ref_q)
        for pool, ref_pool in ((ours.k, ref.k), (ours.v, ref.v), (ours.k_scale, ref.k_scale),
                               (ours.v_scale, ref.v_scale)):
            assert pool is None or torch.equal(pool, ref_pool)
    elif kv_dtype == torch.float8_e4m3fn:
        # The interpreter's fp8 rounding misses values that round up into the next binade (about 1
        # in 100 here); on a GPU the cast is exact. Everything else must match bit for bit.
        for pool, ref_pool in ((ours.k, ref.k), (ours.v, ref.v)):
            assert (pool.view(torch.uint8) != ref_pool.view(torch.uint8)).float().mean() < 0.03
    else:  # the interpreter truncates the rotated bf16 k where torch rounds it: one step apart at most
        for pool, scale, ref_pool, ref_scale in ((ours.k, ours.k_scale, ref.k, ref.k_scale),
                                                 (ours.v, ours.v_scale, ref.v, ref.v_scale)):
            torch.testing.assert_close(dequantized(pool, scale), dequantized(ref_pool, ref_scale), atol=0.05, rtol=0.02)
    untouched = ours.k.view(-1, 3, 24)[[1, 2, 4, 5]]
    assert untouched.float().abs().sum() == 0


def decode_step(dtype, kv_dtype, head_dim=24):
    """A decode step as the model has it before RoPE: unrotated q, k, v views into one projection, the
    new tokens' slots already in the block tables (their K/V not yet written), and a padding row
    (length 0, slot -1) last."""
    lengths = [(1, 1), (1, 17), (1, 64), (1, 150)]  # the new key alone, block edges, several splits
    _, cache, meta = make_batch(lengths, 6, 2, head_dim, dtype, kv_dtype, seed=5)
    for pool in (cache.k, cache.v):
        pool.view(-1, 2, head_dim)[meta.slot_mapping.long()] = 0
    q, k, v = fused_qkv(len(lengths) + 1, 6, 2, head_dim, dtype, seed=6)
    tables = torch.cat([meta.block_tables, torch.zeros_like(meta.block_tables[:1])])
    seq_lens = torch.cat([meta.seq_lens, torch.zeros(1, dtype=torch.int32)])
    slots = torch.cat([meta.slot_mapping, torch.full((1,), -1, dtype=torch.int32)])
    positions = (seq_lens - 1).clamp(min=0).long()
    rotary = cos_sin_cache(head_dim, 256, 10000.0, RopeScaling(8.0, 1.0, 4.0, 64))
    return q, k, v, cache, meta, tables, seq_lens, positions, rotary, slots


def copied(cache: LayerKVCache) -> LayerKVCache:
    return LayerKVCache(*(None if x is None else x.clone() for x in (cache.k, cache.v, cache.k_scale, cache.v_scale)))


@pytest.mark.parametrize("dtype,kv_dtype", [  # two of the four fast
    pytest.param(torch.float32, torch.float32, marks=pytest.mark.slow), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.int8), pytest.param(torch.bfloat16, torch.float8_e4m3fn, marks=pytest.mark.slow),
])
@pytest.mark.parametrize("num_splits,tuning", [(1, None), (4, None), (4, {"DIRECT_KEYS": 64})])
def test_decode_with_fused_rotary_equals_the_two_kernels(kernels, dtype, kv_dtype, num_splits, tuning):
    """RoPE + cache write inside decode attention: the same output and cache, bit for bit, as
    _rotary_write_kv_kernel followed by the decode kernel; q is left unrotated."""
    q, k, v, cache, meta, tables, seq_lens, positions, rotary, slots = decode_step(dtype, kv_dtype)
    fused_cache, two_kernel_cache, q_before = copied(cache), copied(cache), q.clone()
    out = kernels.triton_decode_attention(q, fused_cache, tables, seq_lens, 0.3, num_splits, tuning,
                                          new_tokens=kernels.NewTokens(k, v, positions, rotary, slots))
    assert torch.equal(q, q_before)
    rotated = q.clone()
    kernels.triton_rotary_write_kv(rotated, k, v, positions, rotary, two_kernel_cache, slots)
    expected = kernels.triton_decode_attention(rotated, two_kernel_cache, tables, seq_lens, 0.3, num_splits, tuning)
    assert torch.equal(out, expected)
    for ours, theirs in zip((fused_cache.k, fused_cache.v, fused_cache.k_scale),
                            (two_kernel_cache.k, two_kernel_cache.v, two_kernel_cache.k_scale)):
        assert ours is None or torch.equal(ours, theirs)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # the padding row
    if dtype == torch.float32:  # and the plain-torch definition
        reference_q, reference_cache = q.clone(), copied(cache)
        rotary_write_kv_torch(reference_q, k, v, positions, rotary, reference_cache, slots)
        assert_close(out[:-1], paged_attention_reference(reference_q[:-1], reference_cache, meta, 0.3), dtype)


def test_attention_fuses_rotary_into_decode_only_steps_when_asked(kernels):
    q, k, v, cache, meta, *_ = decode_step(torch.float32, torch.float32)
    q, k, v = q[:-1], k[:-1], v[:-1]  # no padding row: meta describes the four sequences
    positions, rotary = (meta.seq_lens - 1).long(), cos_sin_cache(24, 256, 10000.0, None)
    fused = replace(TRITON, options=KernelOptions(fuse_rotary_into_decode_attention=True,
                                                  decode_attention_tuning_by_batch={8: {"DIRECT_KEYS": 64}}))
    fused_cache, q_before = copied(cache), q.clone()
    out = attention.attention(q, k, v, positions, rotary, fused_cache, meta, 0.3, fused)
    assert torch.equal(q, q_before)  # the fused path took it: the separate kernel rotates q in place
    two_kernel_cache = copied(cache)
    expected = attention.attention(q, k, v, positions, rotary, two_kernel_cache, meta, 0.3, TRITON)
    assert_close(out, expected, torch.float32)
    assert torch.equal(fused_cache.k, two_kernel_cache.k) and torch.equal(fused_cache.v, two_kernel_cache.v)


def test_public_dispatch_takes_triton_when_chosen(kernels):
    q, cache, meta = make_batch([(4, 9), (1, 20)], 4, 2, 24, torch.float32, torch.float32, seed=3)
    k, v = torch.randn(2, 5, 2, 24)
    positions = torch.tensor([5, 6, 7, 8, 19])
    ref_q, ref_cache = q.clone(), LayerKVCache(cache.k.clone(), cache.v.clone())
    attention.rotary_write_kv(q, k, v, positions, ROTARY, cache, meta.slot_mapping, TRITON)
    out = attention.paged_attention(q, cache, meta, 0.25, TRITON)
    rotary_write_kv_torch(ref_q, k, v, positions, ROTARY, ref_cache, meta.slot_mapping)
    assert torch.equal(cache.k, ref_cache.k) and torch.equal(q, ref_q)
    assert_close(out, paged_attention_reference(ref_q, ref_cache, meta, 0.25), torch.float32)


def test_backend_names_are_checked():
    with pytest.raises(ValueError, match="attention_backend"):
        choose_kernels("cuda", KernelOptions(), torch.device("cpu"))
