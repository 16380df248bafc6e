"""The one-call native decoder stack (model/native_decode.py) against the per-op path it replaces
(each op already checked against torch in test_native_kernels.py): same greedy tokens and logprobs
within float32 rounding, on int4 models with and without q/k/v biases, GQA groups of 2 and 4, a
batch of mixed lengths (so block tables of several blocks) and the first layer's missing residual."""

from __future__ import annotations

import pytest
import torch

from goodserve import LLM, SamplingParams
from goodserve.model import native_decode
from goodserve.native.int4_gemv import int8_dot_available
from goodserve.quant.linear import Int4Linear
from helpers import loaded_model

PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40, 17)]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)


def generate(llm: LLM, native: bool):
    model = loaded_model(llm)
    attached = model.native_decode
    if not native:
        model.native_decode = None
    try:
        return llm.generate(PROMPTS, PARAMS)
    finally:
        model.native_decode = attached


@pytest.mark.parametrize("model,group_size,int8_activations",
                         [("dummy:tiny", 32, False), ("dummy:tiny-qwen", 64, False), ("dummy:tiny", 32, True)])
def test_native_decode_layer_matches_the_per_op_path(model, group_size, int8_activations):
    if int8_activations and not int8_dot_available():
        pytest.skip("no int8-activation path in this build")
    llm = LLM(model, quantization="int4", quantization_group_size=group_size, num_kv_blocks=64)
    for module in loaded_model(llm).modules():  # the GGUF layers' arithmetic, on both paths
        if isinstance(module, Int4Linear):
            module.int8_activations = int8_activations
    layers = loaded_model(llm).model.layers
    stack = loaded_model(llm).native_decode
    assert stack is not None and len(stack.layers) == len(layers)
    for layer in layers:  # random models load zero biases: make them count
        if layer.self_attn.qkv_proj.bias is not None:
            layer.self_attn.qkv_proj.bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    calls = []
    original = native_decode.NativeDecodeStack.__call__
    native_decode.NativeDecodeStack.__call__ = lambda self, *args: calls.append(1) or original(self, *args)
    try:
        fused = generate(llm, native=True)
    finally:
        native_decode.NativeDecodeStack.__call__ = original
    assert len(calls) >= PARAMS.max_tokens - 1  # every decode step
    assert all(struct.int8_activations == int8_activations for struct in stack.operands())
    per_op = generate(llm, native=False)
    for ours, ref in zip(fused, per_op):
        # With int8 activations an ulp of difference upstream can move one activation's rounding, so
        # the paths may part at a near tie: compare up to it, and the tie must be one.
        tokens, ref_tokens = ours.outputs[0].token_ids, ref.outputs[0].token_ids
        same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
        if not int8_activations:
            assert same == len(tokens)
        for a, b in zip(ours.outputs[0].logprobs[:same], ref.outputs[0].logprobs[:same]):
            assert a.keys() == b.keys()
            for token in a:
                assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4 if not int8_activations else 2e-2)
        if same < len(tokens):
            parted = ref.outputs[0].logprobs[same]
            assert tokens[same] in parted and parted[ref_tokens[same]].logprob - parted[tokens[same]].logprob < 0.05


def test_only_int4_models_get_it():
    llm = LLM("dummy:tiny", num_kv_blocks=16)  # float32 linears: the per-op path
    assert loaded_model(llm).native_decode is None
    assert native_decode.attach(loaded_model(llm)) is False


def test_one_layer_off_the_native_kernel_keeps_the_whole_model_on_the_per_op_path():
    model = loaded_model(LLM("dummy:tiny", quantization="int4", quantization_group_size=32, num_kv_blocks=16))
    assert model.native_decode is not None
    o_proj = model.model.layers[1].self_attn.o_proj
    model.model.layers[1].self_attn.o_proj = torch.nn.Linear(o_proj.in_features, o_proj.out_features, bias=False)
    assert native_decode.attach(model) is False and model.native_decode is None


def test_the_stack_follows_weights_written_or_replaced_after_attach():
    """Its operands point into layouts built from the codes: codes written in place or replaced,
    or a new norm weight, must reach the next step (compared with the per-op path on the same weights)."""
    llm = LLM("dummy:tiny", quantization="int4", quantization_group_size=32, num_kv_blocks=64)
    model = loaded_model(llm)
    generate(llm, native=True)  # the stack's operands built
    layer = model.model.layers[0]
    layer.mlp.down_proj.qweight.copy_(layer.mlp.down_proj.qweight.flip(0))  # written in place
    qkv = layer.self_attn.qkv_proj
    qkv.scales = qkv.scales * 1.5  # replaced
    layer.post_attention_layernorm.weight = torch.nn.Parameter(layer.post_attention_layernorm.weight * 0.5,
                                                               requires_grad=False)
    fused, per_op = generate(llm, native=True), generate(llm, native=False)
    for ours, ref in zip(fused, per_op):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
