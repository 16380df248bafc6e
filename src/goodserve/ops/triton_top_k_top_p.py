"""Top-k, top-p and min-p (ops/sampler.py) on the GPU without sorting the vocabulary.

Each filter keeps the tokens whose logit is at least a threshold, so a row needs three numbers, not
an order: top-k's is the k-th largest logit; top-p's is the logit at which the mass of the logits
at or above it first reaches p (of the top-k set's mass); min-p's is where exp(x - max) reaches
min_p. The first two are found by radix select over the logits' order-preserving 32-bit keys, four bits a pass:
each pass sums, over the tokens that share the bits chosen so far, the count (top-k) or the
probability mass exp(x - max) (top-p) in each of the 16 values of the next four bits, and keeps the
highest value whose total with everything above still reaches the target. A row costs one read for
its maximum, eight per active threshold, one for top-p's normaliser and one to write; a sort of a
128K vocabulary with its indices, then a softmax, a cumulative sum and a scatter in that order,
costs several times more and dominates a sampled step at hundreds of rows. One program a row, so
no step synchronises with the host. Ties at a threshold are all kept (ops/sampler.py's reference
keeps them too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # logits a loop step


@triton.jit
def _ordered_key(x):
    """float32 -> uint32 with the same order (negative floats' bits flipped, positive ones' sign set;
    -0.0 as +0.0, which it equals)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) == 1, ~bits, bits | 0x80000000)


@triton.jit
def _radix_threshold(row_ptr, vocab, limit, row_max, floor_key, target, BY_MASS: tl.constexpr,
                     BLOCK: tl.constexpr):
    """The largest key T whose tokens at or above it (and at or above floor_key) weigh at least
    target: a token weighs 1, or exp(x - row_max) when BY_MASS. limit is vocab, or 0 to skip the
    row (with target inf the answer is then 0: every token is kept)."""
    digits = tl.arange(0, 16)
    prefix = tl.full([], 0, tl.uint32)  # the threshold's bits chosen so far, high first
    above = 0.0  # the weight of the tokens above the chosen bits' bin
    for level in tl.static_range(8):
        shift = 28 - 4 * level
        hist = tl.zeros((16,), tl.float32)
        for start in range(0, limit, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf"))
            key = _ordered_key(x)
            counted = (offs < vocab) & (key >= floor_key)
            if level > 0:
                counted = counted & ((key >> (shift + 4)) == (prefix >> (shift + 4)))
            if BY_MASS:
                weight = tl.where(counted, tl.exp(x - row_max), 0.0)
            else:
                weight = tl.where(counted, 1.0, 0.0)
            digit = (key >> shift) & 15
            hist += tl.sum(tl.where(digit[:, None] == digits[None, :], weight[:, None], 0.0), axis=0)
        at_or_above = above + tl.cumsum(hist, 0, reverse=True)  # per digit value d: digits >= d
        chosen = tl.max(tl.where(at_or_above >= target, digits, 0))
        above += tl.sum(tl.where(digits > chosen, hist, 0.0))
        prefix = prefix | (chosen.to(tl.uint32) << shift)
    return prefix


@triton.jit
def _top_k_top_p_min_p_kernel(logits_ptr, out_ptr, top_k_ptr, top_p_ptr, min_p_ptr, vocab, stride_l, stride_o,
                              BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_l
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    largest = tl.full((BLOCK,), float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        largest = tl.maximum(largest, tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")))
    row_max = tl.max(largest)
    no_floor = tl.full([], 0, tl.uint32)
    uses_top_k = top_k < vocab
    k_key = _radix_threshold(row_ptr, vocab, tl.where(uses_top_k, vocab, 0), row_max, no_floor,
                             tl.where(uses_top_k, top_k.to(tl.float32), float("inf")), False, BLOCK)
    uses_top_p = top_p < 1.0
    mass = tl.zeros((BLOCK,), tl.float32)  # the top-k set's: top-p's share is of it
    for start in range(0, tl.where(uses_top_p, vocab, 0), BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf"))
        mass += tl.where(_ordered_key(x) >= k_key, tl.exp(x - row_max), 0.0)
    norm = tl.sum(mass)
    p_key = _radix_threshold(row_ptr, vocab, tl.where(uses_top_p, vocab, 0), row_max, k_key,
                             tl.where(uses_top_p, top_p * norm, float("inf")), True, BLOCK)
    threshold = tl.maximum(k_key, p_key)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf"))
        keep = ((_ordered_key(x) >= threshold) & (tl.exp(x - row_max) >= min_p)) | (x == row_max)
        tl.store(out_ptr + row * stride_o + offs, tl.where(keep, x, float("-inf")), mask=offs < vocab)


def triton_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                             min_p: torch.Tensor) -> torch.Tensor:
    """logits: [N, V] float32; top_k [N] (V or more: off), top_p [N] (1: off), min_p [N] (0: off)
    -> the logits with every token outside each row's kept set at -inf."""
    rows, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1, "float32 rows, contiguous"
    out = torch.empty_like(logits)
    if rows > 0:
        _top_k_top_p_min_p_kernel[(rows,)](logits, out, top_k, top_p, min_p, vocab, logits.stride(0), out.stride(0),
                                           BLOCK=BLOCK, num_warps=8)
    return out
