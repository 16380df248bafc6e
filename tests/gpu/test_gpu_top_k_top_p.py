"""The sort-free top-k / top-p / min-p kernel (ops/triton_top_k_top_p.py) compiled on CUDA at the
vocabularies served (Llama 3's 128,256, Qwen's 151,936) and batch sizes up to 256 rows, against
ops/sampler.py's sorted path on the same device: the same kept set on every row, up to the token on
the edge. The CPU suite runs
it under the interpreter at a 1.5K vocabulary."""

from __future__ import annotations

import pytest
import torch

from goodserve.ops.kernel_choice import TORCH_KERNELS
from goodserve.ops.sampler import SamplingBatch, top_k_top_p_min_p
from goodserve.ops.triton_top_k_top_p import triton_top_k_top_p_min_p

# (top_k, top_p, min_p), cycled over the rows; a top_k of 1 << 20 is off.
SETTINGS = [(1 << 20, 0.9, 0.0), (1 << 20, 0.95, 0.0), (50, 0.9, 0.0), (1, 1.0, 0.0), (1 << 20, 1.0, 0.05),
            (1000, 0.99, 0.01), (1 << 20, 0.3, 0.0)]


@pytest.mark.parametrize("rows,vocab", [(1, 128256), (7, 151936), (256, 128256)])
def test_the_compiled_kernel_keeps_the_sorted_paths_set(rows, vocab, device, cuda_only, record_property):
    g = torch.Generator(device=device).manual_seed(rows)
    # Llama 3's generation_config samples at temperature 0.6: logits of a few units, scaled up, from a
    # bf16 model (so ties are common); a grammar's refused tokens at -inf in every third row.
    logits = (torch.randn(rows, vocab, generator=g, device=device) * 3).bfloat16().float() / 0.6
    logits[::3, ::5] = float("-inf")
    top_k, top_p, min_p = zip(*(SETTINGS[row % len(SETTINGS)] for row in range(rows)))
    batch = SamplingBatch(top_k=torch.tensor(top_k, device=device),
                          top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
                          min_p=torch.tensor(min_p, dtype=torch.float32, device=device))
    fast = torch.isfinite(triton_top_k_top_p_min_p(logits, batch.top_k, batch.top_p, batch.min_p))
    sorted_path = torch.isfinite(top_k_top_p_min_p(logits, batch, TORCH_KERNELS))
    differs = fast != sorted_path
    moved_mass = (logits.softmax(dim=-1) * differs).sum(dim=-1)
    record_property("kept_per_row", fast.sum(dim=-1).tolist()[:len(SETTINGS)])
    record_property("rows_differing", int(differs.any(dim=-1).sum()))
    # The kernel sums top-p's mass in another order than the sort's running sum (and exp rounds in
    # its own way), so the token (or tie) at a top-p edge within float32 rounding of p may fall on
    # either side, and tokens whose mass rounds away entirely may too: one edge a row, or a share of
    # the probability under 1e-5. A wrong threshold moves many tokens and real mass.
    edge_only = differs.sum(dim=-1) <= 1
    assert bool((edge_only | (moved_mass < 1e-5)).all()), (differs.sum(dim=-1).tolist(), moved_mass.tolist())
