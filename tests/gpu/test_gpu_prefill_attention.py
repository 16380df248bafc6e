"""Prefill attention on CUDA beyond one program a query block: chunks through torch's FlashAttention
(ops/flash_prefill.py), and few-query launches whose keys split over programs (a prefix hit's
question), against the float32 reference, in a CUDA graph, and in engines against the torch path."""

from __future__ import annotations

import numpy as np
import torch
from gate_checks import TORCH_PATH, assert_within, build, compare, engine_scores, greedy, tolerance

from goodserve.config import KernelOptions
from goodserve.ops.attention import AttentionMetadata, LayerKVCache, paged_attention, paged_attention_reference
from goodserve.ops.flash_prefill import flash_prefill_sequences
from goodserve.ops.kernel_choice import KernelChoice
from goodserve.ops.triton_attention import PREFILL_TUNING, prefill_num_splits, triton_prefill_attention

BLOCK = 16
HEADS = (32, 8, 128)  # Llama-3.1-8B's q heads, KV heads, head dim
SCALE = 128**-0.5
# (queries, context after the step): decodes first, then chunks with and without cached context
LENGTHS = [(1, 40), (1, 300), (64, 64), (9, 50), (48, 400), (200, 1000), (3, 3)]


def paged_batch(lengths: list[tuple[int, int]], capacity: int = 0, seed: int = 0):
    """Random K/V for each sequence's whole context in shuffled blocks, bf16 queries, its metadata;
    the block table has room for `capacity` tokens a sequence (default: the longest context)."""
    num_q_heads, num_kv_heads, head_dim = HEADS
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [-(-seq_len // BLOCK) for _, seq_len in lengths]
    shape = (sum(blocks) + 1, BLOCK, num_kv_heads, head_dim)
    cache = LayerKVCache(*(torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in "kv"))
    order = torch.randperm(shape[0], device="cuda", generator=gen).to(torch.int32)
    table = torch.zeros(len(lengths), max(max(blocks), -(-capacity // BLOCK)), dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(blocks):
        table[i, :n], start = order[start : start + n], start + n
    q_lens, seq_lens = [q for q, _ in lengths], [s for _, s in lengths]
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    meta = AttentionMetadata(
        slot_mapping=torch.full((sum(q_lens),), -1, dtype=torch.int32, device="cuda"),
        query_start_loc=torch.tensor([0, *q_lens], device="cuda").cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), block_tables=table,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_lens_host=q_lens, seq_lens_host=seq_lens)
    return q, cache, meta


def reference(q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata) -> torch.Tensor:
    return paged_attention_reference(q.float(), LayerKVCache(cache.k.float(), cache.v.float()), meta, SCALE)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def test_a_batch_split_between_flash_and_triton_matches_the_reference(cuda_only):
    q, cache, meta = paged_batch(LENGTHS)
    meta.num_leading_decodes = 2
    choice = KernelChoice(triton=True, options=KernelOptions(flash_prefill_min_tokens=48))
    assert flash_prefill_sequences(q, HEADS[1], meta.query_lens_host, 2, 48, None, None) == [2, 4, 5]
    assert rel_err(paged_attention(q, cache, meta, SCALE, choice), reference(q, cache, meta)) < 1e-2


def test_a_few_query_launch_splits_its_keys_and_replays_in_a_graph(cuda_only):
    """20 queries on 4,096 cached tokens (a prefix hit's question): the launch splits each block's keys
    over programs; captured in a graph sized for one sequence, it replays right after the context
    changes, its arrival counters zeroed by each replay."""
    q, cache, meta = paged_batch([(20, 4116)], capacity=8192)
    block_q = PREFILL_TUNING["BLOCK_M"] // (HEADS[0] // HEADS[1])
    assert prefill_num_splits((20 // block_q + 2) * HEADS[1], 8192, q.device, PREFILL_TUNING["SPLIT_KEYS"]) > 1

    def launch():
        return triton_prefill_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, SCALE,
                                        max_seqs=2)

    assert rel_err(launch(), reference(q, cache, meta)) < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = launch()
    for context in (4116, 600, 3000, 4116):
        meta.seq_lens.fill_(context)
        meta.seq_lens_host[0] = meta.max_seq_len = context
        graph.replay()
        assert rel_err(out, reference(q, cache, meta)) < 1e-2, context


def random_ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 40000, n).tolist()


def test_a_prefix_hit_through_a_one_prefill_graph_gives_the_torch_paths_tokens(device, cuda_only):
    """float32, graphs on: a 1,500-token prompt, then questions on it (prefix hits, 20 tokens: one
    prefill sequence, so the one-prefill graph, its keys split) give the torch path's greedy tokens."""
    system = random_ids(1500, 0)
    prompts = [system + random_ids(20, seed) for seed in (1, 2, 3)]
    fast = build("dummy:smollm2-135m", device, dtype="float32", enforce_eager=False, async_scheduling=True)
    hits_before = fast.engine.stats().prefix_cache_hits
    ours = [greedy(fast, [prompt])[0] for prompt in prompts]
    assert fast.engine.stats().prefix_cache_hits > hits_before
    del fast
    torch_path = build("dummy:smollm2-135m", device, dtype="float32", **TORCH_PATH)
    assert ours == [greedy(torch_path, [prompt])[0] for prompt in prompts]


def test_chunks_through_flash_match_the_torch_path(device, cuda_only, record_property):
    """bfloat16, eager steps (prompt logprobs), every prefill chunk of 16 tokens or more through flash:
    the first without context, the later ones on the chunks cached before them."""
    prompt = random_ids(300, 4)
    options = KernelOptions(flash_prefill_min_tokens=16)
    fast = build("dummy:smollm2-135m", device, dtype="bfloat16", max_num_batched_tokens=64, kernels=options)
    q = torch.empty(1, 9, 64, device="cuda", dtype=torch.bfloat16)  # smollm2's heads: 9 q, 3 KV
    assert flash_prefill_sequences(q, 3, [64], 0, 16, None, None) == [0], "flash must take these heads here"
    sequence = prompt + greedy(fast, [prompt])[0]
    ours = engine_scores(fast, [sequence])
    del fast
    torch_path = build("dummy:smollm2-135m", device, dtype="bfloat16", max_num_batched_tokens=64, **TORCH_PATH)
    comparison = compare([sequence], [len(prompt)], ours, engine_scores(torch_path, [sequence]))
    for prop in comparison.properties():
        record_property(*prop)
    assert_within(comparison, tolerance("bfloat16", "auto"))
