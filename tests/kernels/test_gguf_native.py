"""quantization='gguf': the GGUF file's Q4_0 / Q4_1 / Q8_0 codes run as they are.

The references are gguf's own dequantizer (through our float loader) and dense matmuls on its
output; the end-to-end check scores the native engine's greedy tokens with the float model.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from goodserve import LLM, SamplingParams
from goodserve.config import EngineConfig
from goodserve.errors import InvalidRequestError
from goodserve.model.loader import load_model
from goodserve.native.build import library
from goodserve.native.int4_gemv import int8_dot_available
from goodserve.quant.gguf_native import Int8GroupLinear, block_codes, native_linear
from goodserve.quant.linear import CPU_NATIVE_MAX_M, Int4Linear
from helpers import loaded_model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a short poem about the sea."]


@pytest.fixture(scope="module")
def native_llm():
    return LLM("smollm2-135m", quantization="gguf", cpu_kv_cache_bytes=64 << 20)


def _random_tensor(tensor_type, rows: int = 48, cols: int = 96, seed: int = 0):
    """A GGUF-quantized random matrix: (raw blocks, gguf's own dequantization)."""
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(values, tensor_type)
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, tensor_type).reshape(rows, cols))


def _layer(tensor_type, raw: np.ndarray, rows: int, cols: int) -> torch.nn.Module:
    module = native_linear(tensor_type, torch.nn.Linear(cols, rows, bias=False))
    w = block_codes(raw, tensor_type)
    storage = module.pair if isinstance(module, Int8GroupLinear) else module
    storage.qweight.copy_(w.qweight)
    storage.scales.copy_(w.scales)
    storage.zeros.copy_(w.zeros)
    return module


@pytest.mark.parametrize("tensor_type", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
                                         gguf.GGMLQuantizationType.Q8_0])
def test_block_codes_dequantize_to_ggufs_own_values(tensor_type):
    raw, reference = _random_tensor(tensor_type)
    layer = _layer(tensor_type, raw, *reference.shape)
    assert torch.equal(layer.dequantize(torch.float32), reference)


@pytest.mark.parametrize("rows", [1, 2, 5, CPU_NATIVE_MAX_M, CPU_NATIVE_MAX_M + 1])  # decode kernel, prefill matmul
def test_q8_0_layer_matches_a_dense_matmul_on_the_dequantized_table(rows):
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    raw, table = _random_tensor(q8_0, rows=64, cols=128, seed=rows)
    layer = _layer(q8_0, raw, 64, 128)
    layer.pair.int8_activations = True  # the lm_head keeps float32 rows all the same
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    out = layer(x)
    assert out.dtype == torch.float32
    if library() is None and rows <= 2:  # torch's int4 kernel on bf16 rows: a few bf16 steps off
        reference = F.linear(x.bfloat16().float(), table)
        torch.testing.assert_close(out, reference, rtol=0, atol=8e-3 * reference.abs().max().item())
        return
    reference = (x.double() @ table.double().T).float()
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())


def test_q8_0_layer_uses_the_float_table_it_is_given_for_many_rows():
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    raw, table = _random_tensor(q8_0, rows=32, cols=64)
    layer = _layer(q8_0, raw, 32, 64)
    layer.float_weight = torch.zeros_like(table)  # a stand-in that shows which weight was used
    assert layer(torch.randn(CPU_NATIVE_MAX_M + 1, 64)).abs().sum() == 0
    assert layer(torch.randn(1, 64)).abs().sum() > 0


def test_native_layers_hold_exactly_the_float_loaders_weights(native_llm):
    float_model = load_model("smollm2-135m", torch.float32, "cpu").model
    native_model = loaded_model(native_llm)
    native = {name: m for name, m in native_model.named_modules() if isinstance(m, (Int4Linear, Int8GroupLinear))
              and not name.endswith(".pair")}
    assert len(native) == 4 * native_model.spec.num_layers + 1  # every projection, and lm_head (Q8_0)
    assert isinstance(native["lm_head"], Int8GroupLinear)
    assert native["lm_head"].float_weight is native_model.model.embed_tokens.weight  # tied: prefill reads it
    for name, module in native.items():
        assert torch.equal(module.dequantize(torch.float32), float_model.get_submodule(name).weight), name
    assert torch.equal(native_model.model.embed_tokens.weight, float_model.model.embed_tokens.weight)


def set_int8_activations(llm: LLM, on: bool) -> None:
    model = loaded_model(llm)
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.int8_activations = on


# (float32 rows, measured 0 flips in 72 tokens; int8 rows as llama.cpp, measured 5 of 72 and 0.32 nats)
@pytest.mark.parametrize("int8_activations,max_gap,max_flips", [(False, 0.1, 2), (True, 0.5, 8)])
def test_native_greedy_tokens_are_the_float_models_choices(native_llm, embedded_llm, int8_activations, max_gap,
                                                           max_flips):
    """Every token the native engine picks must be the float model's top choice or within max_gap
    nats of it: near ties may flip, the more so with 8-bit activations."""
    if int8_activations and not int8_dot_available():
        pytest.skip("no int8-activation path in this build")
    tok = embedded_llm.tokenizer
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    set_int8_activations(native_llm, int8_activations)
    try:
        native = native_llm.generate([{"prompt_token_ids": tok.encode(p)} for p in PROMPTS], greedy)
    finally:
        set_int8_activations(native_llm, False)  # the default (EngineConfig.cpu_int8_activations)
    flips = 0
    for prompt, out in zip(PROMPTS, native):
        ids, generated = tok.encode(prompt), out.outputs[0].token_ids
        scored = embedded_llm.generate({"prompt_token_ids": ids + generated},
                                       SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
        for position, token in enumerate(generated, start=len(ids)):
            entry = scored.prompt_logprobs[position]
            best = max(lp.logprob for lp in entry.values())
            assert best - entry[token].logprob < max_gap, (prompt, position)
            flips += entry[token].rank != 1
    assert flips <= max_flips


def test_gguf_quantization_refuses_other_models_and_options():
    with pytest.raises(InvalidRequestError, match="not a GGUF model"):
        LLM("dummy:tiny", quantization="gguf")
    for option in ({"quantization_awq": True}, {"quantized_checkpoint": "q.safetensors"},
                   {"quantization_group_size": 64}, {"quantize_lm_head": True}):
        with pytest.raises(InvalidRequestError, match="cannot be combined"):
            EngineConfig(quantization="gguf", **option).validate()
