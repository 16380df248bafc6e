"""AWQ scaling keeps the float model's function and lowers quantization error on its calibration text."""

import torch
from torch import nn

from goodserve.model.llama import LlamaForCausalLM
from goodserve.model.spec import ModelSpec
from goodserve.quant.awq import apply_awq, capture_inputs, fake_quantize

SPEC = ModelSpec(name="tiny", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, max_position_embeddings=128)


def _model_with_outlier_channels() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(SPEC)
    for p in model.parameters():
        nn.init.normal_(p, std=0.1)
    for layer in model.model.layers:  # a few loud input channels, as trained LLMs have
        layer.input_layernorm.weight.data = 1.0 + 9.0 * (torch.arange(64) % 16 == 0).float()
        layer.post_attention_layernorm.weight.data = torch.ones(64)
    return model.eval().requires_grad_(False)


def _quantized_output_error(model, ids, method):
    linears = [m for layer in model.model.layers for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj)]
    inputs = capture_inputs(model, ids, linears)
    return sum(((x @ fake_quantize(lin.weight, method, 32).T) - x @ lin.weight.T).pow(2).mean().item()
               for lin, x in inputs.items())


def test_awq_keeps_the_float_model_and_lowers_int4_error():
    model = _model_with_outlier_channels()
    ids = torch.randint(0, 64, (96,)).tolist()
    # the last o_proj's input: AWQ leaves o_proj alone, and it depends on every earlier layer
    probe = model.model.layers[-1].self_attn.o_proj
    before = capture_inputs(model, ids, [probe])[probe]
    error_before = _quantized_output_error(model, ids, "int4")
    apply_awq(model, ids, "int4", group_size=32)
    after = capture_inputs(model, ids, [probe])[probe]
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    assert _quantized_output_error(model, ids, "int4") < error_before
