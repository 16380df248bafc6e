"""The L2 prefetch decode attention issues for the next kernel's weight (ops/l2_prefetch.py): its
ranges under the interpreter, its PTX compiled for an H100 (no GPU needed; the interpreter cannot
run inline PTX). Bit-equal attention with it on the card: tests/gpu/test_gpu_l2_prefetch.py."""

from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import triton
import triton.language as tl

from goodserve.ops.l2_prefetch import prefetch_ranges, prefetchable


@triton.jit
def _ranges_kernel(start_ptr, size_ptr, num_bytes, THREADS: tl.constexpr):
    program = tl.program_id(0)
    start, size = prefetch_ranges(num_bytes, program, tl.num_programs(0), THREADS)
    offs = program * THREADS + tl.arange(0, THREADS)
    tl.store(start_ptr + offs, start)
    tl.store(size_ptr + offs, size)


@pytest.mark.parametrize("num_bytes, programs, threads", [
    (4096 * 2048 * 2, 128, 128),  # Qwen3-30B-A3B's o_proj over a batch-1 launch: 1 KiB a thread
    (16 * 1000, 3, 32),  # uneven: the last ranges run short, the ones past the end are empty
    (16, 2, 32),  # fewer 16-byte pieces than threads
])
def test_the_ranges_tile_the_bytes_in_16_byte_pieces(num_bytes, programs, threads):
    start = torch.full((programs * threads,), -1, dtype=torch.int64)
    size = torch.full((programs * threads,), -1, dtype=torch.int32)
    _ranges_kernel[(programs,)](start, size, num_bytes, THREADS=threads)
    size, start = size.long(), start
    assert (size >= 0).all() and (size % 16 == 0).all() and (start % 16 == 0).all()
    used = size > 0
    # in thread order, each range starts where the one before ends; together exactly [0, num_bytes)
    assert torch.equal(start[used], torch.cumsum(size[used], 0) - size[used])
    assert size.sum().item() == num_bytes


def test_only_16_bit_weights_on_the_card_are_prefetched():
    """A quantized linear's matmul does not read its float weight, a CPU tensor is no bulk copy's."""
    assert prefetchable(None) is None
    assert prefetchable(torch.zeros(64, 64, dtype=torch.bfloat16)) is None  # on the CPU
    assert prefetchable(torch.zeros(64, 64, dtype=torch.int8)) is None


COMPILE_DECODE_FOR_SM90 = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from goodserve.ops.triton_attention import _decode_kernel as fn

constants = dict(HEAD_DIM=128, GROUP=8, BLOCK_G=16, BLOCK_D=128, BLOCK_N=128, BLOCK_SIZE=16, SPLIT_KEYS=64,
                 NUM_SPLITS=32, KV_QUANT=0, UPCAST_DOT=False, DOT_PRECISION="tf32", BOUNDED=False, ROTARY=True,
                 BLOCK_HALF=64, SOFTCAP=False, PREFETCH=sys.argv[1] == "1", THREADS=128, USE_PDL=True)
pointers = {"q_ptr": "*bf16", "out_ptr": "*bf16", "k_cache": "*bf16", "v_cache": "*bf16", "k_ptr": "*bf16",
            "v_ptr": "*bf16", "prefetch_ptr": "*u8"} | dict.fromkeys(
    ["part_out_ptr", "part_lse_ptr", "k_scale", "v_scale", "rotary_ptr"], "*fp32") | dict.fromkeys(
    ["arrivals_ptr", "block_tables", "seq_lens", "num_decodes_ptr", "positions_ptr", "slot_ptr"], "*i32")
signature = {name: "constexpr" if name in constants else pointers.get(name, "fp32" if name in ("qk_scale", "softcap")
             else "i32") for name in fn.arg_names}
print(triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                     target=GPUTarget("cuda", 90, 32)).asm["ptx"])
"""


@pytest.mark.slow  # a process of its own (Triton's compiler, not its interpreter)
@pytest.mark.parametrize("prefetch", [False, True])
def test_decode_attention_prefetches_before_its_pdl_wait(prefetch):
    """Compiled for an H100: one bulk prefetch a thread, before griddepcontrol.wait (the weight is
    no kernel's output, so its read may overlap the kernel ahead); none without a weight to warm."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    ptx = subprocess.run([sys.executable, "-c", COMPILE_DECODE_FOR_SM90, "1" if prefetch else "0"], env=env,
                         check=True, capture_output=True, text=True, timeout=300).stdout.splitlines()
    prefetches = [i for i, line in enumerate(ptx) if "cp.async.bulk.prefetch.L2.global" in line]
    (wait,) = [i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line]
    if prefetch:
        assert len(prefetches) == 1 and prefetches[0] < wait
    else:
        assert not prefetches
