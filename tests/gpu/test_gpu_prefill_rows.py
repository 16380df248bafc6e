"""int4 and GGUF layers at the row counts that choose their paths: 1 (decode kernels), 33-64 (past
CUDA_KERNEL_MAX_M, within the CPU kernels' bound: the crash this guards against sent such CUDA batches to a
native CPU kernel), 128 and 300 (dequantize, then a dense matmul).

Layers alone against a dense matmul on their own dequantized weight, then the embedded model's
int4 and gguf engines, eager so that a prompt of n tokens is a step of exactly n rows, against the
torch path.
"""

from __future__ import annotations

import gguf
import pytest
import torch
import torch.nn.functional as F
from gate_checks import TORCH_PATH, assert_within, build, compare, engine_scores, greedy, tolerance
from test_gguf_native import _layer, _random_tensor

from goodserve.model.tokenizer_loader import embedded_tokenizer
from goodserve.model_names import EMBEDDED_MODEL
from goodserve.quant.awq import default_calibration_text
from goodserve.quant.linear import Int4Linear

ROWS = (1, 33, 64, 128, 300)
LAYER_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # relative Frobenius error


def int4_layer(tensor_type: str, device: str) -> torch.nn.Module:
    """smollm2's gate_up shape (576 -> 1536): int4 by group of 64, or a GGUF format's codes."""
    if tensor_type == "int4":
        linear = torch.nn.Linear(576, 1536, bias=False)
        torch.nn.init.normal_(linear.weight, std=0.05, generator=torch.Generator().manual_seed(0))
        return Int4Linear.from_linear(linear, group_size=64).to(device)
    kind = gguf.GGMLQuantizationType[tensor_type]
    raw, _ = _random_tensor(kind, rows=1536, cols=576)
    return _layer(kind, raw, 1536, 576).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tensor_type", ["int4", "Q4_0", "Q4_1", "Q8_0"])
def test_layer_matches_dense_matmul_at_every_row_count(tensor_type, dtype, device, record_property):
    layer = int4_layer(tensor_type, device)
    weight = layer.dequantize(torch.float32)
    errors = {}
    for rows in ROWS:
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).to(device, dtype)
        out = layer(x)
        assert out.device == x.device and out.dtype == dtype and out.shape == (rows, 1536)
        reference = F.linear(x.float(), weight)
        errors[rows] = ((out.float() - reference).norm() / reference.norm()).item()
    record_property("max_rel_error_by_rows", errors)
    assert max(errors.values()) <= LAYER_TOLERANCE[dtype], errors


@pytest.mark.parametrize("quantization", ["int4", "gguf"])
def test_embedded_prefill_of_every_row_count(quantization, device, cuda_only, record_property):
    options = dict(dtype="bfloat16", quantization=quantization)
    text_ids = embedded_tokenizer().encode(default_calibration_text())
    prompts = [text_ids[:rows] for rows in ROWS]
    fast = build(EMBEDDED_MODEL, device, enforce_eager=True, **options)
    # One prompt at a time: each prefill is one step of exactly len(prompt) rows.
    tokens = [greedy(fast, [prompt], max_tokens=4)[0] for prompt in prompts]
    sequences = [p + t for p, t in zip(prompts, tokens)]
    ours = engine_scores(fast, sequences)
    del fast
    reference = build(EMBEDDED_MODEL, device, **options, **TORCH_PATH)
    comparison = compare(sequences, [len(p) for p in prompts], ours, engine_scores(reference, sequences))
    for prop in comparison.properties():
        record_property(*prop)
    assert_within(comparison, tolerance("bfloat16", "auto"))
