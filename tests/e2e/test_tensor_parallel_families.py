"""Tensor parallelism of the families beyond Llama on the CPU (gloo, a worker process per rank): Qwen3's
replicated q/k norms, Phi-3's fused checkpoint tensors split per rank, a mixture of experts split inside
every expert (Mixtral, Qwen3-MoE), Gemma 2 and 3 with their norms after each sublayer, soft caps, q/k
norms and sliding windows. Tiny random-weight models made with transformers' config classes: the split
model gives transformers' greedy tokens, as one process does. Quantized experts' shards hold the whole
model's codes; shapes that split no expert, or no int4 group, are refused with what would fit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from goodserve import LLM
from goodserve.errors import InvalidRequestError
from goodserve.model.dummy_loader import load_dummy
from goodserve.model.llama import build_empty_model
from goodserve.model.presets import get_preset
from goodserve.model.tensor_parallel import TensorParallel, check_tensor_parallel_size
from goodserve.quant import schemes
from goodserve.sampling_params import SamplingParams
from helpers import shut_down
from test_families import FAMILIES, MOE, SETTINGS, TINY, hf_greedy, prompts, save_tiny_model
from test_gemma import CONFIGS as GEMMA_CONFIGS

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# 17 and 40 tokens: the second outgrows the Gemma models' window of 16.
PROMPTS = prompts()[1:3]
SPLIT = {"qwen3": FAMILIES["qwen3"], "phi3": FAMILIES["phi3"], "mixtral": FAMILIES["mixtral"],
         "qwen3-moe": FAMILIES["qwen3-moe"]} | GEMMA_CONFIGS
# Experts of 64 columns: 32 a rank, one int4 group of 32.
MOE_64 = dataclasses.replace(get_preset("tiny-moe"), moe_intermediate_size=64)


@pytest.fixture(autouse=True)
def fast_timeout(monkeypatch):
    # The ranks inherit it: a lost peer fails a collective within seconds, not minutes.
    monkeypatch.setenv("GOODSERVE_DISTRIBUTED_TIMEOUT_S", "20")


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


@pytest.mark.parametrize("family", SPLIT)
def test_split_model_gives_transformers_tokens(tmp_path: Path, family: str):
    hf_model = save_tiny_model(SPLIT[family](), tmp_path)
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in PROMPTS]
    assert greedy_tokens(LLM(str(tmp_path), **SETTINGS)) == expected
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **SETTINGS)
    try:
        assert greedy_tokens(llm) == expected
    finally:
        shut_down(llm)


def test_int4_experts_split_give_one_process_tokens(tmp_path: Path):
    """Groups of 32 over the experts' 64 columns: each rank's down projection holds one whole group."""
    save_tiny_model(transformers.Qwen3MoeConfig(**TINY, num_experts=4, moe_intermediate_size=64, **MOE), tmp_path)
    settings = SETTINGS | {"quantization": "int4", "quantization_group_size": 32}
    expected = greedy_tokens(LLM(str(tmp_path), **settings))
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **settings)
    try:
        assert greedy_tokens(llm) == expected
    finally:
        shut_down(llm)


def experts_as_floats(model, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's dequantized stacks as [E, 2, I, H] (each expert's gate, up) and [E, H, I] (its down)."""
    w13, w2 = (schemes.dequantize(stack) for stack in model.model.layers[layer].mlp.experts.stacks())
    spec = model.spec
    return w13.view(spec.num_experts, 2, -1, spec.hidden_size), w2.view(spec.num_experts, spec.hidden_size, -1)


@pytest.mark.parametrize(("method", "group_size"), [("int8", None), ("int4", 32)])
def test_quantized_experts_shards_hold_the_whole_models_codes(method: str, group_size: int | None):
    """Each rank's experts dequantize to exactly its slice of the whole model's: int8's down projection
    scaled by its rows' largest magnitude over both ranks' columns, int4's groups the whole model's."""
    def load(tp: TensorParallel):
        return load_dummy(MOE_64, torch.float32, "cpu", seed=0, tp=tp, quantization=method, group_size=group_size)

    whole = load(TensorParallel())
    shards = [load(TensorParallel(rank, 2)) for rank in range(2)]
    columns = MOE_64.moe_intermediate_size // 2
    for layer in range(MOE_64.num_layers):
        w13, w2 = experts_as_floats(whole, layer)
        for rank, shard in enumerate(shards):
            own = slice(rank * columns, (rank + 1) * columns)
            shard_w13, shard_w2 = experts_as_floats(shard, layer)
            assert torch.equal(shard_w13, w13[:, :, own])
            assert torch.equal(shard_w2, w2[:, :, own])
            assert torch.equal(shard.model.layers[layer].mlp.gate.weight, whole.model.layers[layer].mlp.gate.weight)


def test_sizes_that_split_no_expert_are_refused_with_the_sizes_that_do():
    spec = dataclasses.replace(get_preset("tiny-moe"), moe_intermediate_size=50)  # 4 heads, 2 KV heads
    with pytest.raises(InvalidRequestError, match="each expert's intermediate size 50.*valid sizes: 1, 2$"):
        check_tensor_parallel_size(spec, 4)


def test_int4_groups_must_not_straddle_an_experts_shard():
    """The whole experts' group size (64: their gate and up have 64 inputs, their down 64) is the one
    each rank's 32 columns of the down projection would have to hold whole."""
    with pytest.raises(InvalidRequestError, match=r"group size 64 does not divide the experts' down projection "
                                                  r"\(its 1/2 tensor-parallel shard\)'s input dimension 32"):
        build_empty_model(MOE_64, torch.float32, "cpu", TensorParallel(rank=0, size=2), quantization="int4")
