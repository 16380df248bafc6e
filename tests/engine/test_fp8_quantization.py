"""--quantization fp8 through the engine on a tiny random Llama saved as a Hugging Face directory:
logits near transformers' float ones, greedy tokens mostly the float path's, and the combinations
(fp8 KV cache, a self:fp8 draft model) running."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from goodserve import LLM, SamplingParams
from goodserve.cli import main
from goodserve.model.loader import load_model
from goodserve.quant.apply import quantize_model
from goodserve.quant.fp8_linear import Fp8Linear
from helpers import loaded_model
from test_loaders import TINY, save_tiny_hf_model
from test_model_hf import PagedSequence

transformers = pytest.importorskip("transformers")

PROMPTS = [[3, 17, 42, 99, 5], [250, 8, 8, 61], [7, 140, 33, 12, 290, 1, 64], [120, 121, 122]]
NEW_TOKENS = 16
# Measured on this model: the fp8 model's logits are off transformers' float ones by 2.5% at the median
# position and 4.6% at worst (relative norm; int8 weight-only: 0.6% and 1.1%), the top token the same
# at 38 of 40 positions. Greedy agreement (the share of generated tokens before the first difference,
# as `goodserve eval` counts it) is harsh on a random model's flat logits: 0.59 (int8: 0.77), 0.36
# with an fp8 KV cache too. The embedded model's numbers are in docs/quantization.md.
LOGITS_MEDIAN_REL_ERROR = 0.04
LOGITS_MAX_REL_ERROR = 0.08
MIN_GREEDY_AGREEMENT = 0.5
MIN_GREEDY_AGREEMENT_FP8_KV = 0.25


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("tiny-llama")
    model = save_tiny_hf_model(transformers.LlamaConfig(**TINY), path)
    return path, model


def test_logits_near_transformers_float(hf_dir):
    path, hf_model = hf_dir
    loaded = load_model(str(path), torch.float32, "cpu")
    quantize_model(loaded.model, "fp8")
    assert sum(isinstance(m, Fp8Linear) for m in loaded.model.modules()) == 4 * TINY["num_hidden_layers"]
    ids = torch.randint(0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0]
    got = PagedSequence(loaded.model).step(ids)
    error = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert error.median() < LOGITS_MEDIAN_REL_ERROR and error.max() < LOGITS_MAX_REL_ERROR
    assert error.median() > 1e-3  # the layers did quantize: the float path itself matches to ~1e-6


def greedy_tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of generated positions before each pair's first difference (after it the contexts differ)."""
    same = 0
    for x, y in zip(a, b):
        same += next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
    return same / sum(len(x) for x in a)


@pytest.fixture(scope="module")
def float_tokens(hf_dir) -> list[list[int]]:
    return greedy_tokens(LLM(str(hf_dir[0]), quantization="none", num_kv_blocks=32))


def test_greedy_generation_agrees_with_the_float_path(hf_dir, float_tokens):
    fp8 = LLM(str(hf_dir[0]), quantization="fp8", num_kv_blocks=32)
    assert isinstance(loaded_model(fp8).model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert agreement(greedy_tokens(fp8), float_tokens) >= MIN_GREEDY_AGREEMENT


def test_with_an_fp8_kv_cache(hf_dir, float_tokens):
    both = LLM(str(hf_dir[0]), quantization="fp8", kv_cache_dtype="fp8", num_kv_blocks=32)
    assert agreement(greedy_tokens(both), float_tokens) >= MIN_GREEDY_AGREEMENT_FP8_KV


def test_self_fp8_draft_keeps_the_targets_greedy_tokens(hf_dir, float_tokens):
    """Drafts are verified by the float target: its greedy tokens exactly, whatever the draft proposes."""
    llm = LLM(str(hf_dir[0]), quantization="none", speculative_model="self:fp8", num_speculative_tokens=3,
              spec_policy="always", num_kv_blocks=64)
    assert greedy_tokens(llm) == float_tokens
    assert llm.engine.stats().spec_decode_num_accepted_tokens > 0  # the draft ran, and mostly agreed


def test_goodserve_quantize_fp8_checkpoint_serves_the_tokens_quantizing_at_load_gives(tmp_path):
    path = tmp_path / "tiny-fp8.safetensors"
    assert main(["quantize", "--model", "dummy:tiny-qwen", "--quantization", "fp8", "--output", str(path)]) == 0
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 9, 13, 2]}
    at_load = LLM("dummy:tiny-qwen", quantization="fp8", num_kv_blocks=16).generate(prompt, params)
    from_file = LLM("dummy:tiny-qwen", quantized_checkpoint=str(path), num_kv_blocks=16)
    assert isinstance(loaded_model(from_file).model.layers[0].mlp.gate_up_proj, Fp8Linear)
    assert from_file.generate(prompt, params)[0].outputs[0].token_ids == at_load[0].outputs[0].token_ids
