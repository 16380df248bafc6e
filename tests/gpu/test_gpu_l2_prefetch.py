"""Decode attention that warms L2 with the output projection's weight first (ops/l2_prefetch.py,
KernelOptions.decode_attention_prefetch_max_batch): a hint to the memory system, so the attention
and the cache it writes are bit-equal to the launch without it, in and out of a CUDA graph, and an
engine's greedy tokens equal the same engine's without it."""

from __future__ import annotations

import torch
from gate_checks import build, greedy

from goodserve.config import KernelOptions
from goodserve.ops.attention import LayerKVCache
from goodserve.ops.l2_prefetch import prefetchable
from goodserve.ops.rotary import cos_sin_cache
from goodserve.ops.triton_attention import NewTokens, triton_decode_attention

BLOCK = 16
HEADS = (32, 4, 128)  # Qwen3-30B-A3B's q heads, KV heads, head dim


def _decode_step(prefetch: torch.Tensor | None, graph: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch-1 decode launch with RoPE and the cache write fused, on fixed random inputs ->
    (attention output, K pool, V pool)."""
    num_q_heads, num_kv_heads, head_dim = HEADS
    gen = torch.Generator(device="cuda").manual_seed(0)
    context = 300
    shape = (context // BLOCK + 2, BLOCK, num_kv_heads, head_dim)
    cache = LayerKVCache(*(torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in "kv"))
    table = torch.randperm(shape[0], device="cuda", generator=gen).to(torch.int32)[None]
    q = torch.randn(1, num_q_heads, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(1, num_kv_heads, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in "kv")
    positions = torch.tensor([context - 1], device="cuda")
    slot = (table[0, (context - 1) // BLOCK] * BLOCK + (context - 1) % BLOCK).to(torch.int32).reshape(1)
    new = NewTokens(k, v, positions, cos_sin_cache(head_dim, 4096, 1e6, None).cuda(), slot)
    seq_lens = torch.tensor([context], dtype=torch.int32, device="cuda")
    launch = lambda: triton_decode_attention(q, cache, table, seq_lens, head_dim**-0.5, pdl=True,  # noqa: E731
                                             new_tokens=new, prefetch=prefetch)
    out = launch()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = launch()
        g.replay()
    torch.cuda.synchronize()
    return out, cache.k, cache.v


def test_decode_attention_with_the_prefetch_is_bit_equal(cuda_only):
    weight = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)  # its o_proj
    assert prefetchable(weight) is not None and prefetchable(weight[:, 1:]) is None
    for graph in (False, True):
        want, got = _decode_step(None, graph), _decode_step(prefetchable(weight), graph)
        assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_an_engine_with_the_prefetch_gives_the_same_tokens(device, cuda_only):
    prompts = [[1, 5, 9, 200, 7] * 6, [3, 4] * 20]
    tokens = []
    for max_batch in (0, 16):
        llm = build("dummy:tiny", device, dtype="bfloat16",
                    kernels=KernelOptions(decode_attention_prefetch_max_batch=max_batch))
        attn = llm.engine.executor.worker.runner.model.model.layers[0].self_attn
        assert prefetchable(attn.o_proj.weight) is not None  # what its decode launches warm L2 with
        tokens.append(greedy(llm, prompts))
    assert tokens[0] == tokens[1]
