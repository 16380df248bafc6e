"""Warming L2 with the weight the next kernel reads, from a launch that leaves HBM idle.

At a few decode rows, decode attention runs a handful of programs for a few microseconds on a few
kilobytes of K/V; HBM idles until the output projection after it starts reading its weight. Given
that weight, the attention launch first spreads cp.async.bulk.prefetch.L2 requests for its bytes
over all its programs' threads (a fire-and-forget hint: nothing lands in registers), then waits for
the kernel ahead as usual: the weight is no kernel's output, so it may be read before the PDL wait,
and the read overlaps the attention (and the norm ahead of it, which its programs share the GPU
with under PDL) instead of following it. An H100's L2 (50 MB) holds an 8B model's o_proj (32 MiB).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BULK_ALIGNMENT = tl.constexpr(16)  # cp.async.bulk: address and size in multiples of 16 bytes


def prefetchable(weight: torch.Tensor | None) -> torch.Tensor | None:
    """A 16-bit weight's bytes as a flat uint8 CUDA tensor, or None where a bulk prefetch cannot take
    them (not on CUDA, not contiguous, not 16-byte aligned) or the matmul would not read them (a
    quantized linear's weight, whose matmul reads codes and scales or a repacked copy)."""
    if weight is None or weight.dtype not in (torch.bfloat16, torch.float16):
        return None
    if not weight.is_cuda or not weight.is_contiguous():
        return None
    if weight.data_ptr() % BULK_ALIGNMENT.value or weight.nbytes % BULK_ALIGNMENT.value:
        return None
    return weight.view(-1).view(torch.uint8)


@triton.jit
def prefetch_ranges(num_bytes, program, num_programs, THREADS: tl.constexpr):
    """Program `program` of `num_programs`: each of its THREADS threads' (start, size) in
    [0, num_bytes), sizes multiples of 16 (num_bytes is one) and 0 past the end, the programs' ranges
    tiling it in order."""
    chunk = tl.cdiv(tl.cdiv(num_bytes, num_programs * THREADS), BULK_ALIGNMENT) * BULK_ALIGNMENT
    start = (program * THREADS + tl.arange(0, THREADS)).to(tl.int64) * chunk
    return start, tl.minimum(tl.maximum(num_bytes - start, 0), chunk).to(tl.int32)


@triton.jit
def prefetch_to_l2(bytes_ptr, num_bytes, program, num_programs, THREADS: tl.constexpr):
    """Program `program` of `num_programs` asks L2 for its share of bytes_ptr[:num_bytes], one bulk
    prefetch a thread (THREADS: the launch's threads a program). Inline PTX: CUDA only."""
    start, size = prefetch_ranges(num_bytes, program, num_programs, THREADS)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [bytes_ptr + start, size], dtype=tl.int32, is_pure=False, pack=1)
