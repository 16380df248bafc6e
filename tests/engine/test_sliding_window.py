"""Sliding-window attention: tiny random Mistral models against transformers, and what goodserve refuses."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from goodserve.errors import GoodserveError
from goodserve.llm import LLM
from goodserve.sampling_params import SamplingParams
from goodserve.model.loader import load_spec
from test_calc import run_calc
from test_loaders import TINY, save_tiny_hf_model

transformers = pytest.importorskip("transformers")

WINDOW = 64


def mistral_config(**overrides):
    return transformers.MistralConfig(**{**TINY, "max_position_embeddings": 512, "sliding_window": WINDOW,
                                         **overrides})


@pytest.fixture(scope="module")
def windowed_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mistral-window")
    save_tiny_hf_model(mistral_config(), path)
    return path


def test_window_is_read_from_config(windowed_dir: Path):
    assert load_spec(str(windowed_dir)).layer_windows == (WINDOW, WINDOW)


def test_lookahead_is_refused_with_a_window(windowed_dir: Path):
    with pytest.raises(GoodserveError, match="'lookahead' is not supported with .*sliding-window"):
        LLM(str(windowed_dir), device="cpu", dtype="float32", speculative_method="lookahead")


@pytest.mark.parametrize("overrides, message", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                          "rope_theta": 10000.0}}, "rope scaling 'yarn' is not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     "rope scaling 'dynamic' is not supported"),
])
def test_unimplemented_rope_scaling_is_refused(tmp_path: Path, overrides: dict, message: str):
    save_tiny_hf_model(transformers.LlamaConfig(**TINY, **overrides), tmp_path)
    with pytest.raises(GoodserveError, match=message):
        LLM(str(tmp_path), device="cpu", dtype="float32")


def test_llama_attention_bias_is_refused(tmp_path: Path):
    save_tiny_hf_model(transformers.LlamaConfig(**TINY, attention_bias=True), tmp_path)
    with pytest.raises(GoodserveError, match="attention_bias=True"):
        LLM(str(tmp_path), device="cpu", dtype="float32")


def test_calc_kv_reads_the_shape_of_an_architecture_it_cannot_load(tmp_path: Path, capsys):
    config = transformers.LlamaConfig(**TINY, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                               "original_max_position_embeddings": 64,
                                                               "rope_theta": 10000.0})
    config.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "architectures": ["SomeNewForCausalLM"]}))
    assert run_calc("kv", "--model", str(tmp_path), "--batch", "1", "--seq-len", "1000", "--kv-dtype", "fp32") == 0
    # 2 (K and V) x 2 layers x 2 KV heads x 16 dims x 4 bytes
    assert "KV per token: 0.5 KiB" in capsys.readouterr().out


def transformers_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts_around_the_window(vocab: int, window: int) -> list[list[int]]:
    """Shorter than, equal to and over twice the window; one shares the long one's first tokens
    (a prefix-cache hit once the long one has run)."""
    gen = torch.Generator().manual_seed(3)
    long = torch.randint(3, vocab, (2 * window + 22,), generator=gen).tolist()
    return [long, torch.randint(3, vocab, (window,), generator=gen).tolist(),
            long[:20] + torch.randint(3, vocab, (10,), generator=gen).tolist(), long[:5]]


NEW_TOKENS = 32


def assert_greedy_equals_transformers(path: Path, hf_model, vocab: int, window: int, device: str = "cpu",
                                      **engine_options):
    """hf_model (on the CPU) is the reference for ours on `device`, float32 both."""
    prompts = prompts_around_the_window(vocab, window)
    expected = [transformers_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    # Small steps: prompts are prefilled in chunks; the second batch hits the first's cached prefixes.
    llm = LLM(str(path), device=device, dtype="float32", max_num_batched_tokens=32, enable_chunked_prefill=True,
              enable_prefix_caching=True, **engine_options)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(inputs, params)] == expected
    for prompt, tokens in zip(inputs, expected):
        assert llm.generate(prompt, params)[0].outputs[0].token_ids == tokens


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_greedy_tokens_equal_transformers_past_the_window(tmp_path: Path, backend: str):
    hf_model = save_tiny_hf_model(mistral_config(sliding_window=24), tmp_path)
    assert_greedy_equals_transformers(tmp_path, hf_model, TINY["vocab_size"], 24, attention_backend=backend)


def test_kv_bytes_of_local_layers_are_capped_at_the_window():
    """Gemma-3-like: 5 local layers (window 1024) to 1 global; at 32k a local layer keeps 1024 tokens."""
    from goodserve.diagnose.calc import kv_cache_bytes
    from goodserve.diagnose.roofline import decode_step_bytes, weight_bytes
    from goodserve.model.presets import get_preset

    spec = get_preset("tiny")
    hybrid = dataclasses.replace(spec, num_layers=6, layer_windows=(1024,) * 5 + (None,))
    per_token_layer = 2 * spec.num_kv_heads * spec.head_dim * 2  # K and V, fp16
    assert kv_cache_bytes(hybrid, 32768, batch=3) == 3 * per_token_layer * (5 * 1024 + 32768)
    assert kv_cache_bytes(hybrid, 512) == 6 * 512 * per_token_layer  # within the window: every token
    table = 512 * 64 * 2  # the untied 512 x 64 embedding table, of which a step reads a row a token
    assert decode_step_bytes(hybrid, 2, 32768, kv_dtype="fp16") == \
        weight_bytes(hybrid) - table + 2 * per_token_layer * (5 * 1024 + 32768)


def test_calc_kv_reports_the_window(windowed_dir: Path, capsys):
    assert run_calc("kv", "--model", str(windowed_dir), "--batch", "1", "--seq-len", "640", "--kv-dtype", "fp32") == 0
    out = capsys.readouterr().out
    # 2 layers x 64 tokens of 640, each layer's token 2 (K, V) x 2 heads x 16 dims x 4 bytes
    assert "2 of 2 layers keep their last 64 tokens: a sequence of 640 holds 0.000 GB (10% of all-global's" in out


def test_hybrid_layers_greedy_tokens_equal_transformers(tmp_path: Path):
    """Windows on some layers only (Qwen2's use_sliding_window: layers from max_window_layers on are
    local): each layer its own window, the others the whole context; no block is released early."""
    config = transformers.Qwen2Config(**{**TINY, "num_hidden_layers": 3, "max_position_embeddings": 512},
                                      use_sliding_window=True, sliding_window=24, max_window_layers=1)
    hf_model = save_tiny_hf_model(config, tmp_path)
    assert load_spec(str(tmp_path)).layer_windows == (None, 24, 24)
    assert_greedy_equals_transformers(tmp_path, hf_model, TINY["vocab_size"], 24, attention_backend="torch")
