"""The q/k norm inside the qkv projection's GEMV launch (ops/triton_gemv.py, KernelOptions.gemv_qk_norm)
compiled on CUDA at the shapes whose decode rows the engine routes to the GEMV: each head's last row
block, counted by an atomic across SMs, norms the head from the other programs' stores. Against the
projection then the separate q/k norm kernel, on the same device and weights, in and out of a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from goodserve.ops.norm import HeadNorm
from goodserve.ops.triton_gemv import TUNED_CONFIGS, dense_gemv, gemv_config, norms_heads, split_counters
from goodserve.ops.triton_ops import triton_qk_rms_norm_

# (q heads, kv heads, hidden): Qwen3-30B-A3B's qkv_proj (one K slice a program), Qwen3-8B's (split K)
SHAPES = {"qwen3-30b-a3b": (32, 4, 2048), "qwen3-8b": (32, 8, 4096)}
HEAD_DIM = 128


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_gemv_norms_the_heads_it_projects(shape, weight_offset, device, cuda_only):
    heads, kv_heads, hidden = SHAPES[shape]
    n = (heads + 2 * kv_heads) * HEAD_DIM
    assert ("dense", 1, n, hidden) in TUNED_CONFIGS  # the engine's own launch
    g = torch.Generator().manual_seed(heads + kv_heads)
    weight = (torch.randn(n, hidden, generator=g) * 0.02).to(device, torch.bfloat16)
    x = torch.randn(1, hidden, generator=g).to(device, torch.bfloat16)
    norm = HeadNorm(*((1 + 0.3 * torch.randn(HEAD_DIM, generator=g)).to(device, torch.bfloat16) for _ in range(2)),
                    heads, kv_heads, HEAD_DIM, 1e-6, weight_offset)
    assert norms_heads(gemv_config("dense", 1, n, hidden, 0, weight.device), norm)
    want = dense_gemv(x, weight, pdl=True)
    triton_qk_rms_norm_(want, norm.q_weight, norm.k_weight, heads, kv_heads, HEAD_DIM, norm.eps, True, weight_offset)

    got = [dense_gemv(x, weight, pdl=True, head_norm=norm) for _ in range(3)]
    graph_out = torch.empty_like(want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out.copy_(dense_gemv(x, weight, pdl=True, head_norm=norm))
    for _ in range(3):
        graph.replay()
        got.append(graph_out.clone())
    torch.cuda.synchronize()
    # The same stored projection, normed by the same function; the head's sum of squares may reduce
    # in another order, so a value may round one bf16 step apart.
    for out in got:
        torch.testing.assert_close(out, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
        assert torch.equal(out[:, (heads + kv_heads) * HEAD_DIM:], want[:, (heads + kv_heads) * HEAD_DIM:])
    assert all(torch.equal(out, got[0]) for out in got)  # every launch and replay found its counters reset
    assert not split_counters(weight.device).any()
