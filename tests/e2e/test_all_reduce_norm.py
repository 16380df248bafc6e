"""The all-reduce fused with the residual add and RMSNorm (ops/all_reduce_norm.py), run by two
"ranks": two processes under TRITON_INTERPRET=1 whose buffers are shared memory mapped at different
addresses in each, as CUDA IPC maps a peer's buffer. Each rank spins on its own buffer until the
other's rows arrive, so the calls really wait on each other.

The calls go through TensorParallel.all_reduce_add_rms_norm, as a decoder layer's norm makes them.
References: the sum of both ranks' partial rows (float32, rank order, rounded once), then the Triton
add_rms_norm kernel that the fused kernel replaces (same bits) and the torch reference (tolerance);
and what the same ranks get from gloo's all-reduce and the norm, the path a CPU run takes."""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from goodserve.ops.norm import add_rms_norm_torch

WORLD, HIDDEN, EPS = 2, 48, 1e-5
ROWS = [1, 3, 2, 3, 1, 4]  # calls of different sizes: both parities, each slot cleared and reused
SLOT_BYTES = 4 * 4 * HIDDEN


def _inputs(call: int, rows: int, dtype: torch.dtype):
    """Each rank's partial rows, and the residual and weight every rank holds alike; exact zeros and
    -0.0 among the partials (-0.0 is the kernel's "not arrived" mark in 16-bit types)."""
    g = torch.Generator().manual_seed(call)
    partials = torch.randn(WORLD, rows, HIDDEN, generator=g).to(dtype)
    partials[0, 0, :4] = 0.0
    partials[1, 0, :4] = -0.0
    partials[0, -1, 5] = -0.0
    residual = torch.randn(rows, HIDDEN, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(dtype)
    return partials, residual, weight


def _rank_main(rank: int, buffers: list[torch.Tensor], dtype: torch.dtype, init_file: str, results) -> None:
    """Each call through TensorParallel.all_reduce_add_rms_norm twice, as a decoder layer's norm makes
    it: with the fused kernel, and (the same rank, the same inputs) with gloo's all-reduce and then
    the norm, the path every CPU run takes."""
    os.environ["TRITON_INTERPRET"] = "1"
    from goodserve.model.custom_all_reduce import CustomAllReduce
    from goodserve.model.tensor_parallel import TensorParallel
    from goodserve.ops.all_reduce_norm import LamportBuffers
    from goodserve.ops.kernel_choice import TORCH_KERNELS

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    addresses = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    lamport = LamportBuffers(buffers[rank], addresses, torch.zeros(max(ROWS), dtype=torch.int32), rank, WORLD, SLOT_BYTES)
    # No one-shot buffer (that kernel is CUDA's): a plain all-reduce goes to gloo, one before a norm to the kernel.
    fused = TensorParallel(rank, WORLD, custom_all_reduce=CustomAllReduce(torch.empty(0, dtype=torch.uint8), "", lamport))
    plain = TensorParallel(rank, WORLD)
    outs, gloo = [], []
    for call, rows in enumerate(ROWS):
        partials, residual, weight = _inputs(call, rows, dtype)
        assert fused.custom_all_reduce.fuses(partials[rank])
        outs.append(fused.all_reduce_add_rms_norm(partials[rank], residual, weight, EPS, TORCH_KERNELS))
        gloo.append(plain.all_reduce_add_rms_norm(partials[rank].clone(), residual, weight, EPS, TORCH_KERNELS))
    dist.destroy_process_group()
    saved = io.BytesIO()
    torch.save((outs, lamport.parity, gloo), saved)  # bytes, not tensors: a tensor crosses the queue as shared memory of a process that exits
    results.put((rank, saved.getvalue()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_two_ranks_get_the_all_reduce_then_add_rms_norm(dtype, tmp_path):
    from goodserve.ops.all_reduce_norm import fill_with_marks
    from goodserve.ops.triton_ops import triton_add_rms_norm

    context = mp.get_context("spawn")
    buffers = [torch.empty(2 * WORLD * SLOT_BYTES, dtype=torch.uint8).share_memory_() for _ in range(WORLD)]
    for buffer in buffers:
        fill_with_marks(buffer)
    results = context.Queue()
    ranks = [context.Process(target=_rank_main, args=(rank, buffers, dtype, str(tmp_path / "init"), results))
             for rank in range(WORLD)]
    for process in ranks:
        process.start()
    got = {rank: torch.load(io.BytesIO(saved)) for rank, saved in (results.get(timeout=240) for _ in ranks)}
    for process in ranks:
        process.join(120)
        assert process.exitcode == 0

    for call, rows in enumerate(ROWS):
        partials, residual, weight = _inputs(call, rows, dtype)
        reduced = partials.float().sum(0).to(dtype)
        expected_out, expected_residual = triton_add_rms_norm(reduced, residual, weight, EPS)
        reference_out, reference_residual = add_rms_norm_torch(reduced, residual, weight, EPS)
        out, new_residual = got[0][0][call]
        assert torch.equal(out, got[1][0][call][0]) and torch.equal(new_residual, got[1][0][call][1])  # same bits on every rank
        if dtype == torch.float32:  # the interpreter rounds float32 to bfloat16 by truncation, a GPU to nearest
            assert torch.equal(out, expected_out) and torch.equal(new_residual, expected_residual)
        # bfloat16: within two of its steps (the interpreter's truncations); a rank's row missing or
        # counted twice would be off by the row itself.
        tolerance = {"rtol": 2 ** -6, "atol": 2 ** -6} if dtype == torch.bfloat16 else {}
        torch.testing.assert_close(out, reference_out, **tolerance)
        torch.testing.assert_close(new_residual, reference_residual, **tolerance)
        for rank in range(WORLD):  # what the same ranks got from gloo's all-reduce and the norm
            gloo_out, gloo_residual = got[rank][2][call]
            torch.testing.assert_close(out, gloo_out, **tolerance)
            torch.testing.assert_close(new_residual, gloo_residual, **tolerance)
    # A row's calls alternate between the two parities of slots (a peer a call ahead writes to the other).
    calls_per_row = torch.tensor([sum(rows > row for rows in ROWS) for row in range(max(ROWS))], dtype=torch.int32)
    assert all(torch.equal(got[rank][1], calls_per_row % 2) for rank in range(WORLD))
    # Every slot read was given its marks back: the buffers are as they started.
    marks = torch.empty_like(buffers[0])
    fill_with_marks(marks)
    assert all(torch.equal(buffer, marks) for buffer in buffers)
