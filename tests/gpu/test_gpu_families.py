"""Each model family of tests/engine/test_families.py and tests/engine/test_gemma.py on the device: float32
with CUDA graphs against transformers on the same checkpoint (the fused MoE, q/k norms, LongRoPE tables,
Gemma's soft-capped attention and two rotary tables through the Triton kernels), and bfloat16 against
goodserve's own torch path, eager, scored by the gate's tolerances. The mixtures of experts also in int8
and int4 (the fused MoE on their codes): float32 against transformers on the dequantized weights,
bfloat16 against the torch path in int8."""

from __future__ import annotations

import pytest
import transformers
from gate_checks import MODES, TORCH_PATH, assert_within, build, compare, engine_scores, greedy, hf_scores, tolerance
from test_families import FAMILIES as OTHER_FAMILIES
from test_families import prompts, save_tiny_model
from test_gemma import CONFIGS as GEMMA_FAMILIES
from test_moe_quantized import int4_ready, with_dequantized_weights

FAMILIES = OTHER_FAMILIES | GEMMA_FAMILIES
MOE_FAMILIES = ("mixtral", "qwen3-moe")


def _compare(fast, reference_scores, record_property, dtype: str) -> None:
    ids = prompts()
    tokens = greedy(fast, ids)
    sequences = [p + t for p, t in zip(ids, tokens)]
    comparison = compare(sequences, [len(p) for p in ids], engine_scores(fast, sequences), reference_scores(sequences))
    for prop in comparison.properties():
        record_property(*prop)
    assert_within(comparison, tolerance(dtype, "auto"))


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_matches_transformers(tmp_path, device, family, record_property):
    save_tiny_model(FAMILIES[family](), tmp_path)
    # Eager attention: the one of transformers' implementations that soft-caps Gemma 2's scores.
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    hf_model = hf_model.to(device).eval()
    fast = build(str(tmp_path), device, dtype="float32", **MODES["graphs"])
    _compare(fast, lambda sequences: hf_scores(hf_model, sequences), record_property, "float32")


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_matches_the_torch_path(tmp_path, device, family, record_property):
    save_tiny_model(FAMILIES[family](), tmp_path)
    reference = build(str(tmp_path), device, dtype="bfloat16", **TORCH_PATH)
    fast = build(str(tmp_path), device, dtype="bfloat16", **MODES["graphs+async"])
    _compare(fast, lambda sequences: engine_scores(reference, sequences), record_property, "bfloat16")


def _save_for(method: str, family: str, path) -> None:
    config = FAMILIES[family]()
    save_tiny_model(int4_ready(config) if method == "int4" else config, path)


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_quantized_moe_float32_matches_transformers_on_the_dequantized_weights(tmp_path, device, family, method,
                                                                               record_property):
    _save_for(method, family, tmp_path)
    hf_model = with_dequantized_weights(transformers.AutoModelForCausalLM.from_pretrained(tmp_path), method).to(device)
    fast = build(str(tmp_path), device, dtype="float32", quantization=method, quantization_group_size=32,
                 **MODES["graphs"])
    _compare(fast, lambda sequences: hf_scores(hf_model.eval(), sequences), record_property, "float32")


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_quantized_moe_bfloat16_matches_the_torch_path(tmp_path, device, family, method, record_property):
    _save_for(method, family, tmp_path)
    settings = dict(dtype="bfloat16", quantization=method, quantization_group_size=32)
    reference = build(str(tmp_path), device, **settings, **TORCH_PATH)
    fast = build(str(tmp_path), device, **settings, **MODES["graphs+async"])
    _compare(fast, lambda sequences: engine_scores(reference, sequences), record_property, "bfloat16")
