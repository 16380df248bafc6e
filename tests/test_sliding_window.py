"""Sliding-window attention: tiny random Mistral models against transformers, and what goodserve refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from goodserve.errors import GoodserveError
from goodserve.llm import LLM
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


def test_a_context_past_the_window_is_refused(windowed_dir: Path):
    with pytest.raises(GoodserveError, match=f"sliding-window attention \\({WINDOW} tokens\\).*--max-model-len {WINDOW}"):
        LLM(str(windowed_dir), device="cpu", dtype="float32")


def test_a_context_within_the_window_is_served(windowed_dir: Path):
    assert LLM(str(windowed_dir), device="cpu", dtype="float32", max_model_len=WINDOW).engine.config.max_model_len == WINDOW


@pytest.mark.parametrize("overrides, message", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                          "rope_theta": 10000.0}}, "rope scaling 'yarn' is not supported"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
     "rope scaling 'linear' is not supported"),
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
