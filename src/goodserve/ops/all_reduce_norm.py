"""Tensor parallelism's all-reduce fused with the residual add and RMSNorm that follow it, in one
kernel on symmetric memory: the sum of the ranks' row-parallel outputs (o_proj's, down_proj's),
plus the residual, normed; what vLLM's and TensorRT-LLM's fused all-reduce kernels do.

Unfused, a decode layer's two all-reduces each cost a one-shot kernel (copy in, a signal-pad barrier
with every peer, read and sum) and then the norm's own launch: ~12.5 us an all-reduce inside an H100
decode step (benchmarks/results/gpu_tp_h100x4.json). Here there is no barrier: the buffer holds a
mark where no value has arrived (Lamport's trick), so each program writes its row into every rank's
buffer and then waits, element by element, until its peers' rows have replaced the marks in its own.
The mark is -0.0 in 16-bit types (a rank sends +0.0 for it: the same number) and a float32 denormal
no activation takes; the buffer starts filled with it.

Each rank's buffer holds two parities x world slots. A row's calls alternate parities (the parity
per row lives on the device, so CUDA-graph replays advance it), and the reader puts the marks back
as soon as it has read a slot: a peer can write into that slot again only two calls later, after
this rank's next call has written to it, which starts after this kernel ends. Every rank sums the
slots in rank order, so all ranks get the same bits.

The ranks must make the same calls in the same order with the same rows (tensor parallelism's
steps do: a collective in any form needs it); each program waits only on its peers' program of the
same row, which writes before it waits, so the calls cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from goodserve.ops.triton_ops import add_residual_and_norm, row_num_warps

# A 16-bit word of the buffer where nothing has arrived: -0.0 in bfloat16 and float16; two of them
# make the float32 mark (0x80008000, a negative denormal: -4.6e-41).
MARK_WORD = -32768  # 0x8000 as int16
MARK16: tl.constexpr = tl.constexpr(MARK_WORD)
MARK32: tl.constexpr = tl.constexpr(MARK_WORD * 65536 + 32768)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class LamportBuffers:
    """One rank's view of the group's buffers: `own` this rank's (uint8, held here so it lives as long
    as its users), `addresses` [world] int64, where each rank's buffer lies in this process's address
    space (this rank's at index `rank`); `parity` [rows] int32, per row the parity its next call takes.
    Each buffer: 2 parities x world slots of `slot_bytes`."""

    own: torch.Tensor
    addresses: torch.Tensor
    parity: torch.Tensor
    rank: int
    world: int
    slot_bytes: int

    def takes(self, x: torch.Tensor) -> bool:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        return (x.dtype in DTYPES and x.is_contiguous() and 0 < x.numel() * x.element_size() <= self.slot_bytes
                and rows <= self.parity.numel())


def fill_with_marks(buffer: torch.Tensor) -> None:
    """buffer (uint8, an even number of bytes): every 16-bit word the mark."""
    buffer.view(torch.int16).fill_(MARK_WORD)


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            buffers: LamportBuffers) -> tuple[torch.Tensor, torch.Tensor]:
    """x: this rank's partial sum [..., hidden]. Returns (rms_norm(sum over ranks of x + residual),
    sum over ranks of x + residual), as the all-reduce followed by add_rms_norm would."""
    hidden = x.shape[-1]
    x2, res2 = x.reshape(-1, hidden), residual.contiguous().reshape(-1, hidden)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    new_residual = torch.empty_like(x)
    block = triton.next_power_of_2(hidden)
    _all_reduce_add_rms_norm_kernel[(x2.shape[0],)](
        x2, res2, weight, out.view(-1, hidden), new_residual.view(-1, hidden), buffers.addresses, buffers.parity,
        buffers.rank, hidden, buffers.slot_bytes // x.element_size(), eps,
        WORLD=buffers.world, BLOCK=block, WORDS_32=x.element_size() == 4, num_warps=row_num_warps(block))
    return out, new_residual


@triton.jit
def _all_reduce_add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, addresses_ptr,
                                    parity_ptr, rank, hidden, slot_elems, eps,
                                    WORLD: tl.constexpr, BLOCK: tl.constexpr, WORDS_32: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    parity = tl.load(parity_ptr + row).to(tl.int64)
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0)
    x = tl.where(_is_mark(x, WORDS_32), 0.0, x).to(x.dtype)
    dtype = x_ptr.dtype.element_ty
    # Row `row` of slot (parity, source) in any rank's buffer.
    mine = (parity * WORLD + rank) * slot_elems + row * hidden + cols
    for r in tl.static_range(WORLD):
        peer = tl.load(addresses_ptr + r).to(tl.pointer_type(dtype))
        tl.store(peer + mine, x, mask=mask)
    own = tl.load(addresses_ptr + rank).to(tl.pointer_type(dtype))
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        theirs = own + (parity * WORLD + r) * slot_elems + row * hidden + cols
        value = tl.load(theirs, mask=mask, other=0.0, volatile=True)
        while tl.sum((_is_mark(value, WORDS_32) & mask).to(tl.int32), axis=0) > 0:
            value = tl.load(theirs, mask=mask, other=0.0, volatile=True)
        total += value.to(tl.float32)
        tl.store(theirs, _mark(dtype, BLOCK, WORDS_32), mask=mask)
    tl.store(parity_ptr + row, (1 - parity).to(tl.int32))
    # The sum is rounded to the activation dtype, as the unfused all-reduce's output is.
    add_residual_and_norm(total.to(dtype), row, cols, mask, residual_ptr, weight_ptr, out_ptr, new_residual_ptr,
                          hidden, hidden, hidden, hidden, eps, True)


@triton.jit
def _is_mark(value, WORDS_32: tl.constexpr):
    if WORDS_32:
        marked = value.to(tl.int32, bitcast=True) == MARK32
    else:
        marked = value.to(tl.int16, bitcast=True) == MARK16
    return marked


@triton.jit
def _mark(dtype: tl.constexpr, BLOCK: tl.constexpr, WORDS_32: tl.constexpr):
    if WORDS_32:
        marks = tl.full([BLOCK], MARK32, tl.int32).to(dtype, bitcast=True)
    else:
        marks = tl.full([BLOCK], MARK16, tl.int16).to(dtype, bitcast=True)
    return marks
