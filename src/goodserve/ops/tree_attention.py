"""Attention for side branches: tokens computed in a step whose K/V never enter the KV cache.

Lookahead decoding (engine/spec_decode/lookahead.py) runs, beside a sequence's own tokens, a tree of
guessed tokens hung after its last one: each branch token sees the sequence's cached context and its
own ancestors in the tree, nothing else (not its siblings, not the drafts the same row verifies, not
other sequences' tokens). The tree is given by parent indices (-1: hangs from the context's last
token); a token at depth d sits at position context_len - 1 + d.

The branch tokens ride at the end of the flat batch, after every sequence's own tokens, with slot
-1 (nothing is written). `attention` hands the leading rows to the usual paged path with the main
metadata (so the native and Triton kernels see an ordinary batch) and the trailing ones here: RoPE
in torch, then per tree one masked SDPA over [cached context | the tree's own K/V].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class BranchTree:
    seq: int  # the sequence's index in the batch (its block table row)
    start: int  # its tokens' rows [start, end) among the branch rows (0 = the first branch row)
    end: int
    context_len: int  # cached tokens it sees: the sequence's tokens up to its last own one
    mask: torch.Tensor  # [n, n] bool: token i sees token j (j an ancestor of i, or i itself)


@dataclass
class SideBranches:
    first_row: int  # rows from here on (of the flat batch) are branch tokens
    main: object  # AttentionMetadata of the rows before: an ordinary batch
    trees: list[BranchTree]


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: row i is True at i and at each of its ancestors (parents[j] < j, -1 for a root)."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


def tree_depths(parents: list[int]) -> list[int]:
    """Each token's depth below the context's last token (a root is at depth 1)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def as_cached(x: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """x [n, Hk, D] as the cache would give it back: rounded through an int8 or fp8 pool's codes, so a
    branch token's K/V are those its own token would have once cached (the same per-head int8 scale
    as ops/attention.quantize_int8_per_head)."""
    if pool.dtype == torch.int8:
        scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127.0
        return (torch.round(x.float() / scale).clamp(-127, 127) * scale).to(x.dtype)
    return x.to(pool.dtype).to(x.dtype)


def branch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_k: list[torch.Tensor],
                     context_v: list[torch.Tensor], trees: list[BranchTree], scale: float) -> torch.Tensor:
    """q [n, Hq, D], k / v [n, Hk, D] (rotated, as cached) of all branch tokens; context_k/v[t]
    [context_len, Hk, D] of tree t -> [n, Hq, D]."""
    out = torch.empty_like(q)
    for tree, ctx_k, ctx_v in zip(trees, context_k, context_v):
        rows = slice(tree.start, tree.end)
        keys, values = torch.cat([ctx_k, k[rows]]), torch.cat([ctx_v, v[rows]])
        visible = torch.cat([tree.mask.new_ones(tree.end - tree.start, tree.context_len), tree.mask], dim=1)
        out[rows] = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=visible.to(q.device),
            scale=scale, enable_gqa=q.shape[1] != k.shape[1]).transpose(0, 1)
    return out
