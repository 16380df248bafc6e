"""Hugging Face FP8 checkpoints (quant_method "fp8"): block-scaled (weight_scale_inv, as Qwen3-8B-FP8
ships) and per-channel (weight_scale) ones load dequantized, their logits those of transformers on
the dequantized weights; scales in another shard are found; other quantization methods are refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import safetensors.torch
import torch

from goodserve import LLM, SamplingParams
from goodserve.errors import ModelLoadError
from goodserve.model.loader import load_model
from goodserve.quant.fp8_linear import Fp8Linear
from helpers import loaded_model
from test_loaders import TINY, save_tiny_hf_model
from test_model_hf import PagedSequence, assert_logits_close

transformers = pytest.importorskip("transformers")

BLOCK = 32  # the tiny model's intermediate size 112 leaves a partial block
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def block_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales [ceil(N / B), ceil(K / B)]) with w ~= codes * scale of its block."""
    n, k = weight.shape
    rows, cols = math.ceil(n / BLOCK), math.ceil(k / BLOCK)
    padded = torch.zeros(rows * BLOCK, cols * BLOCK)
    padded[:n, :k] = weight
    blocks = padded.reshape(rows, BLOCK, cols, BLOCK)
    scales = blocks.abs().amax(dim=(1, 3)) / 448
    codes = (blocks / scales[:, None, :, None]).to(torch.float8_e4m3fn).reshape(rows * BLOCK, cols * BLOCK)
    return codes[:n, :k].contiguous(), scales


def channel_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales = weight.abs().amax(dim=1, keepdim=True) / 448
    return (weight / scales).to(torch.float8_e4m3fn), scales


def save_fp8_checkpoint(hf_model, path: Path, block: bool) -> dict[str, torch.Tensor]:
    """Writes an FP8 copy of hf_model (the scales in a second shard); returns its dequantized state dict."""
    path.mkdir()
    state = {name: t.detach().clone() for name, t in hf_model.state_dict().items()}
    weights, scales, dequantized = {}, {}, dict(state)
    for name, tensor in state.items():
        if name.rsplit(".", 2)[-2] in PROJECTIONS:
            codes, scale = (block_fp8 if block else channel_fp8)(tensor)
            weights[name] = codes
            if block:
                scales[name.replace(".weight", ".weight_scale_inv")] = scale
                expanded = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
                expanded = expanded[: tensor.shape[0], : tensor.shape[1]]
            else:
                scales[name.replace(".weight", ".weight_scale")] = scale
                scales[name.replace(".weight", ".input_scale")] = torch.tensor(0.01)  # static: dropped
                expanded = scale
            dequantized[name] = codes.float() * expanded
        else:
            weights[name] = tensor
    safetensors.torch.save_file(weights, path / "model-00001-of-00002.safetensors")
    safetensors.torch.save_file(scales, path / "model-00002-of-00002.safetensors")
    config = hf_model.config.to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic" if block else "static",
                                     **({"weight_block_size": [BLOCK, BLOCK]} if block else {})}
    (path / "config.json").write_text(json.dumps(config))
    return dequantized


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return save_tiny_hf_model(transformers.LlamaConfig(**TINY), tmp_path_factory.mktemp("float"))


@pytest.mark.parametrize("block", [True, False], ids=["block_scales", "channel_scales"])
def test_fp8_checkpoint_loads_as_its_dequantized_weights(hf_model, tmp_path, block):
    dequantized = save_fp8_checkpoint(hf_model, tmp_path / "fp8", block)
    reference = transformers.LlamaForCausalLM(hf_model.config).eval()
    reference.load_state_dict(dequantized)
    ids = torch.randint(0, TINY["vocab_size"], (30,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0]
        float_logits = hf_model(torch.tensor([ids])).logits[0]
    loaded = load_model(str(tmp_path / "fp8"), torch.float32, "cpu")
    got = PagedSequence(loaded.model).step(ids)
    assert_logits_close(got, want)
    assert not torch.allclose(got, float_logits, rtol=1e-4, atol=1e-4)  # the codes did round the weights


def test_fp8_checkpoint_served_with_fp8_layers(hf_model, tmp_path):
    save_fp8_checkpoint(hf_model, tmp_path / "fp8", block=True)
    llm = LLM(str(tmp_path / "fp8"), quantization="fp8", num_kv_blocks=32)
    assert isinstance(loaded_model(llm).model.layers[1].mlp.down_proj, Fp8Linear)
    out = llm.generate({"prompt_token_ids": [3, 17, 42]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_other_quantized_checkpoints_are_refused(hf_model, tmp_path):
    path = tmp_path / "gptq"
    hf_model.save_pretrained(path, safe_serialization=True)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quantized with 'gptq'.*--quantization int8 / int4 / fp8"):
        load_model(str(path), torch.float32, "cpu")
