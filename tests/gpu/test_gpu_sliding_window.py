"""Sliding-window attention on CUDA (Triton decode and prefill kernels, CUDA graphs, async scheduling):
float32 greedy tokens of tiny random models equal transformers' (on the CPU), every layer local and
hybrid (the pool's layer groups), past the window, batched and alone, chunked prefill and prefix-cache hits."""

from __future__ import annotations

import pytest
from test_families import save_tiny_model
from test_gemma import gemma3_config
from test_hybrid_kv_pool import assert_tokens_equal_transformers_in_a_tight_pool
from test_loaders import TINY, save_tiny_hf_model
from test_sliding_window import assert_greedy_equals_transformers, mistral_config

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("hybrid", [False, True], ids=["every-layer-local", "hybrid"])
def test_windowed_greedy_tokens_equal_transformers_on_cuda(tmp_path, cuda_only, hybrid):
    if hybrid:
        config = transformers.Qwen2Config(**{**TINY, "num_hidden_layers": 3, "max_position_embeddings": 512},
                                          use_sliding_window=True, sliding_window=24, max_window_layers=1)
    else:
        config = mistral_config(sliding_window=24)
    hf_model = save_tiny_hf_model(config, tmp_path)
    assert_greedy_equals_transformers(tmp_path, hf_model, TINY["vocab_size"], 24, device="cuda")


def test_hybrid_pool_greedy_tokens_equal_transformers_on_cuda(tmp_path, cuda_only):
    """Gemma 3's layer groups (engine/setup/kv_groups.py) through the Triton kernels, CUDA graphs and async
    scheduling, in a pool whose released local blocks are soon reused."""
    save_tiny_model(gemma3_config(), tmp_path)
    assert_tokens_equal_transformers_in_a_tight_pool(tmp_path, device="cuda")
