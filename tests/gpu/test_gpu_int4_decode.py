"""The batch-1 int4 decode paths that are off by default (benchmarks/gpu_int4.py measures them): the
rows kernel's paired copy with SwiGLU in its epilogue (KernelOptions.int4_fused_silu_and_mul) and an
int4 lm_head (lm_head_quantization "int4"), on CUDA, where the CPU suite cannot reach them (the fused
path takes CUDA rows only).

A layer against the unfused path and against its own dequantized weight, then an engine with both
options and every int4 layer on rows_repacked against the torch path with the default kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gate_checks import TORCH_PATH, assert_within, build, compare, engine_scores, greedy, tolerance

from goodserve.config import KernelOptions
from goodserve.ops.activation import silu_and_mul_torch
from goodserve.ops.kernel_choice import KernelChoice
from goodserve.quant.linear import Int4Linear

HIDDEN, INTERMEDIATE, GROUP = 512, 768, 128


def choice(fused: bool, split_k: int | None) -> KernelChoice:
    shape = (2 * INTERMEDIATE, HIDDEN)
    config = {"split_k": split_k, "denormal": True}
    options = KernelOptions(int4_one_row_kernel="rows_repacked", int4_fused_silu_and_mul=fused,
                            int4_rows_configs={shape: config})
    return KernelChoice(triton=True, pdl=True, options=options)


@pytest.mark.parametrize("split_k", [1, None])  # None: the split rule's (4 slices here)
def test_fused_silu_and_mul_matches_projection_then_activation(split_k, device, cuda_only, record_property):
    linear = torch.nn.Linear(HIDDEN, 2 * INTERMEDIATE, bias=False)
    torch.nn.init.normal_(linear.weight, std=0.05, generator=torch.Generator().manual_seed(0))
    layer = Int4Linear.from_linear(linear.to(torch.bfloat16), GROUP).to(device)
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
    reference = silu_and_mul_torch(F.linear(x.float(), layer.dequantize(torch.float32)).to(torch.bfloat16)).float()

    layer.kernels = choice(False, split_k)
    unfused = layer.silu_and_mul(x).float()
    layer.kernels = choice(True, split_k)
    fused = layer.silu_and_mul(x).float()
    assert layer._rows_layout is not None and layer._rows_layout[1].paired  # the fused path ran
    plain = layer(x).float()  # the paired copy, stored back in row order

    errors = {name: ((out - reference).norm() / reference.norm()).item()
              for name, out in (("fused", fused), ("unfused", unfused))}
    record_property("rel_errors", errors)
    record_property("fused_vs_unfused_max_abs", (fused - unfused).abs().max().item())
    assert fused.shape == (1, INTERMEDIATE) and max(errors.values()) < 1e-2
    torch.testing.assert_close(fused, unfused, rtol=1e-2, atol=1e-3)
    dense = F.linear(x.float(), layer.dequantize(torch.float32))
    assert ((plain - dense).norm() / dense.norm()).item() < 1e-2


def test_int4_decode_fast_paths_match_the_torch_path(device, cuda_only, record_property):
    options = dict(dtype="bfloat16", quantization="int4", quantize_lm_head=True, lm_head_quantization="int4")
    shapes = [(128, 64), (64, 64), (256, 64), (64, 128), (512, 64)]  # dummy:tiny's qkv, o, gate_up, down, lm_head
    kernels = KernelOptions(int4_one_row_kernel="rows_repacked", int4_fused_silu_and_mul=True,
                            int4_rows_configs={shape: {"denormal": True} for shape in shapes})
    fast = build("dummy:tiny", device, kernels=kernels, enforce_eager=False, async_scheduling=True, **options)
    prompts = [[5, 17, 99, 3, 250], [42, 7, 11]]
    tokens = [greedy(fast, [prompt])[0] for prompt in prompts]  # one at a time: decode steps of one row
    model = fast.engine.executor.worker.runner.model
    assert isinstance(model.lm_head, Int4Linear)
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert {m.rows_overrides.get("denormal") for m in layers} == {True}
    paired = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
              if isinstance(m, Int4Linear) and m._rows_layout is not None and m._rows_layout[1].paired}
    assert paired == {"gate_up_proj"}  # the layers silu_and_mul runs on; the others keep plain copies
    sequences = [p + t for p, t in zip(prompts, tokens)]
    ours = engine_scores(fast, sequences)
    del fast
    reference = build("dummy:tiny", device, **options, **TORCH_PATH)
    comparison = compare(sequences, [len(p) for p in prompts], ours, engine_scores(reference, sequences))
    for prop in comparison.properties():
        record_property(*prop)
    assert_within(comparison, tolerance("bfloat16", "auto"))
