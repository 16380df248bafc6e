"""Prefill chunks through torch's FlashAttention (ops/flash_prefill.py) on CUDA: a batch split between
flash and the Triton kernels against the float32 reference, and the embedded model in bfloat16,
every chunk through flash, against transformers."""

from __future__ import annotations

import torch
from gate_checks import assert_within, build, compare, engine_scores, greedy, hf_scores, tolerance

from goodserve.config import KernelOptions
from goodserve.model.tokenizer_loader import embedded_tokenizer
from goodserve.model_names import EMBEDDED_MODEL
from goodserve.ops.attention import AttentionMetadata, LayerKVCache, paged_attention, paged_attention_reference
from goodserve.ops.flash_prefill import flash_prefill_sequences
from goodserve.ops.kernel_choice import KernelChoice
from goodserve.quant.awq import default_calibration_text

BLOCK = 16
# (queries, context after the step): decodes first, then chunks with and without cached context
LENGTHS = [(1, 40), (1, 300), (64, 64), (9, 50), (48, 400), (200, 1000), (3, 3)]


def paged_batch(heads: tuple[int, int, int], seed: int = 0):
    """Random K/V for each sequence's whole context in shuffled blocks, bf16 queries, its metadata."""
    num_q_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [-(-seq_len // BLOCK) for _, seq_len in LENGTHS]
    shape = (sum(blocks) + 1, BLOCK, num_kv_heads, head_dim)
    cache = LayerKVCache(*(torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in "kv"))
    order = torch.randperm(shape[0], device="cuda", generator=gen).to(torch.int32)
    table = torch.zeros(len(LENGTHS), max(blocks), dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(blocks):
        table[i, :n], start = order[start : start + n], start + n
    q_lens, seq_lens = [q for q, _ in LENGTHS], [s for _, s in LENGTHS]
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    meta = AttentionMetadata(
        slot_mapping=torch.full((sum(q_lens),), -1, dtype=torch.int32, device="cuda"),
        query_start_loc=torch.tensor([0, *q_lens], device="cuda").cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), block_tables=table,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_lens_host=q_lens, seq_lens_host=seq_lens,
        num_leading_decodes=2)
    return q, cache, meta


def test_a_batch_split_between_flash_and_triton_matches_the_reference(cuda_only):
    q, cache, meta = paged_batch((32, 8, 128))
    choice = KernelChoice(triton=True, options=KernelOptions(flash_prefill_min_tokens=48))
    assert flash_prefill_sequences(q, 8, meta.query_lens_host, 2, 48, None, None) == [2, 4, 5]
    out = paged_attention(q, cache, meta, 128**-0.5, choice).float()
    ref = paged_attention_reference(q.float(), LayerKVCache(cache.k.float(), cache.v.float()), meta, 128**-0.5)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2  # bf16 probabilities and outputs


def test_chunks_through_flash_match_transformers(device, cuda_only, hf_embedded_on_device, record_property):
    """Eager steps (no mixed graphs), every prefill chunk of 16 tokens or more through flash: the first
    chunk without context, the later ones on the chunks cached before them."""
    prompt = embedded_tokenizer().encode(default_calibration_text())[:200]
    options = KernelOptions(mixed_graph_max_tokens=0, flash_prefill_min_tokens=16)
    llm = build(EMBEDDED_MODEL, device, dtype="bfloat16", max_num_batched_tokens=64, kernels=options)
    q = torch.empty(1, 9, 64, device="cuda", dtype=torch.bfloat16)  # the embedded model's heads: 9 q, 3 KV
    assert flash_prefill_sequences(q, 3, [64], 0, 16, None, None) == [0], "flash must take these heads here"
    sequence = prompt + greedy(llm, [prompt])[0]
    comparison = compare([sequence], [len(prompt)], engine_scores(llm, [sequence]),
                         hf_scores(hf_embedded_on_device, [sequence]))
    for prop in comparison.properties():
        record_property(*prop)
    assert_within(comparison, tolerance("bfloat16", "auto"))
