"""The sort-free top-k / top-p / min-p kernel (ops/triton_top_k_top_p.py) under TRITON_INTERPRET=1
against ops/sampler.py's sorted path and a row-by-row reference from the definitions."""

import math
import os
import subprocess
import sys

import pytest
import torch

from goodserve.ops.kernel_choice import TORCH_KERNELS, KernelChoice
from goodserve.ops.sampler import TRITON_FILTER_MIN_ROWS, SamplingBatch, sample, top_k_top_p_min_p
from goodserve.ops.triton_top_k_top_p import BLOCK, triton_top_k_top_p_min_p

VOCAB = BLOCK + 477  # a partial last block
# (top_k, top_p, min_p) per row: each filter alone, together, and off; top_k >= VOCAB is off.
SETTINGS = [(VOCAB, 0.9, 0.0), (VOCAB, 0.5, 0.0), (VOCAB, 0.05, 0.0), (50, 1.0, 0.0), (1, 1.0, 0.0),
            (40, 0.8, 0.0), (VOCAB, 1.0, 0.02), (200, 0.95, 0.01), (VOCAB, 1.0, 0.0), (VOCAB + 5, 0.99, 0.0)]


def batch_of(settings) -> SamplingBatch:
    top_k, top_p, min_p = zip(*settings)
    return SamplingBatch(top_k=torch.tensor(top_k), top_p=torch.tensor(top_p, dtype=torch.float32),
                         min_p=torch.tensor(min_p, dtype=torch.float32))


def kept_by_definition(row: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """Top-k: the tokens at or above the k-th logit; top-p: the shortest run down the sorted top-k set
    whose mass reaches p (of that set's mass), widened to every token tied with its last; min-p:
    exp(x - max) >= min_p. The top token always stays."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    top = row[order[0]]
    in_top_k = [i for i in order if row[i] >= row[order[min(top_k, len(row)) - 1]]]
    z = sum(math.exp(row[i] - top) for i in in_top_k)
    run, mass = [], 0.0
    for i in in_top_k:
        if run and top_p < 1 and mass >= top_p:
            break
        run.append(i)
        mass += math.exp(row[i] - top) / z
    edge = row[run[-1]]
    return {i for i in in_top_k if row[i] >= edge and math.exp(row[i] - top) >= min_p} | {order[0]}


def kept(masked: torch.Tensor) -> list[set[int]]:
    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in masked]


@pytest.mark.parametrize("scale", [1.0, pytest.param(4.0, marks=pytest.mark.slow), 12.0])  # flat to sharp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16 logits tie often
def test_the_kernel_keeps_the_sorted_paths_set(scale, dtype):
    g = torch.Generator().manual_seed(int(scale))
    logits = (torch.randn(len(SETTINGS), VOCAB, generator=g) * scale).to(dtype).float()
    logits[0, ::7] = float("-inf")  # a grammar's refused tokens
    batch = batch_of(SETTINGS)
    triton_kept = kept(triton_top_k_top_p_min_p(logits, batch.top_k, batch.top_p, batch.min_p))
    assert triton_kept == kept(top_k_top_p_min_p(logits, batch, TORCH_KERNELS))
    refused = set(range(0, VOCAB, 7))  # row 0's -inf tokens: the definition sees them as very unlikely
    for row, (top_k, top_p, min_p) in enumerate(SETTINGS):
        finite = [x if math.isfinite(x) else -1e30 for x in logits[row].tolist()]
        expected = kept_by_definition(finite, top_k, top_p, min_p) - (refused if row == 0 else set())
        assert triton_kept[row] == expected


def test_ties_at_an_edge_are_all_kept_by_both_paths():
    logits = torch.full((5, VOCAB), -5.0)
    logits[:, :4] = torch.tensor([3.0, 2.0, 2.0, 2.0])  # the 2nd..4th tie
    logits[4, :4] = torch.tensor([3.0, 0.0, -0.0, -5.0])  # signed zeros: equal logits
    batch = batch_of([(2, 1.0, 0.0), (VOCAB, 0.6, 0.0), (VOCAB, 1.0, 0.3), (2, 0.6, 0.0), (2, 1.0, 0.0)])
    # top-2 ends inside the tie; so does top-p 0.6 (token 0 holds 0.38, with token 1 0.52), alone and
    # over top-2's four tokens (0.48, then 0.65); min-p 0.3 keeps all four (e^-1 >= 0.3)
    expected = [{0, 1, 2, 3}] * 4 + [{0, 1, 2}]
    assert kept(triton_top_k_top_p_min_p(logits, batch.top_k, batch.top_p, batch.min_p)) == expected
    assert kept(top_k_top_p_min_p(logits, batch, TORCH_KERNELS)) == expected


def test_the_kernel_reads_rows_apart_in_a_wider_tensor():
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(len(SETTINGS), VOCAB + 37, generator=g) * 4
    batch = batch_of(SETTINGS)
    assert kept(triton_top_k_top_p_min_p(wide[:, :VOCAB], batch.top_k, batch.top_p, batch.min_p)) == kept(
        top_k_top_p_min_p(wide[:, :VOCAB].contiguous(), batch, TORCH_KERNELS))


def test_a_sampled_step_draws_the_same_tokens_on_either_path():
    rows = TRITON_FILTER_MIN_ROWS  # the fewest that take the kernel
    settings = [SETTINGS[row % len(SETTINGS)] for row in range(rows)]
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, VOCAB, generator=g) * 3
    batch = batch_of(settings)
    batch.temperature = torch.full((rows,), 0.7)
    batch.generators = [torch.Generator().manual_seed(row) for row in range(rows)]
    on_torch = sample(logits, batch, TORCH_KERNELS)
    batch.generators = [torch.Generator().manual_seed(row) for row in range(rows)]
    on_triton = sample(logits, batch, KernelChoice(triton=True))
    assert torch.equal(on_triton.token_ids, on_torch.token_ids)
    torch.testing.assert_close(on_triton.probs, on_torch.probs)


COMPILE_FOR_HOPPER = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from goodserve.ops.triton_top_k_top_p import BLOCK, _top_k_top_p_min_p_kernel
signature = {"logits_ptr": "*fp32", "out_ptr": "*fp32", "top_k_ptr": "*i64", "top_p_ptr": "*fp32",
             "min_p_ptr": "*fp32", "vocab": "i32", "stride_l": "i32", "stride_o": "i32", "BLOCK": "constexpr"}
source = ASTSource(fn=_top_k_top_p_min_p_kernel, signature=signature, constexprs={"BLOCK": BLOCK})
assert compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["cubin"]
"""


@pytest.mark.slow  # a process of its own (Triton's compiler, not its interpreter)
def test_the_kernel_compiles_for_hopper():
    """The interpreter runs what the compiler refuses (a constexpr reassigned in an unrolled loop did);
    Triton's own ptxas builds the sm_90 binary here, without a GPU."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
