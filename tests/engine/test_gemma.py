"""Gemma 2 and Gemma 3 (text) against transformers: tiny random-weight models made with transformers'
own config classes (float32, a sliding window of 16 that the longer prompts outgrow), loaded from their
Hugging Face directory and as llama.cpp's GGUF; goodserve's greedy tokens equal transformers' generate,
batched and alone, on the torch path and on the Triton kernels (under the interpreter). The soft caps
are set low enough that they change the answer (a test of them could not fail otherwise)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch

from goodserve.errors import InvalidRequestError
from goodserve.llm import LLM
from goodserve.model.loader import load_model, load_spec
from goodserve.ops.rope_scaling import LinearRope
from test_families import SETTINGS, TINY, assert_greedy_matches, prompts, save_tiny_model, write_gguf
from test_model_hf import PagedSequence, assert_logits_close

transformers = pytest.importorskip("transformers")

WINDOW = 16
# Tied embeddings, as Gemma's checkpoints (llama.cpp's gemma2 has no output tensor).
GEMMA = TINY | dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24, tie_word_embeddings=True,
                    attn_implementation="eager")


def gemma2_config(**overrides):
    """Four layers, local and global in turn; weights large enough and caps low enough that the caps
    change scores and logits by far more than float32's error."""
    return transformers.Gemma2Config(**(GEMMA | dict(num_hidden_layers=4, initializer_range=0.1,
                                                     attn_logit_softcapping=1.0, final_logit_softcapping=2.0)
                                        | overrides))


def gemma3_config(**overrides):
    """Six layers, five local to one global; the global layers' rope linearly scaled (as 12B/27B's), the
    local ones on their own base."""
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}}
    return transformers.Gemma3TextConfig(**(GEMMA | dict(num_hidden_layers=6, rope_parameters=rope) | overrides))


CONFIGS = {"gemma2": gemma2_config, "gemma3": gemma3_config}


@pytest.mark.parametrize("family", CONFIGS)
def test_greedy_tokens_match_transformers(tmp_path: Path, family: str):
    hf_model = save_tiny_model(CONFIGS[family](), tmp_path)
    assert_greedy_matches(str(tmp_path), hf_model, prompts())


def test_gemma2_logits_are_soft_capped_as_transformers_caps_them(tmp_path: Path):
    """Greedy tokens cannot see the final cap (tanh keeps the order): the logits can, at the prompt's
    last position and at each decode step after it."""
    hf_model = save_tiny_model(gemma2_config(), tmp_path)
    ours = PagedSequence(load_model(str(tmp_path), torch.float32, "cpu").model, num_blocks=8)
    prompt, new_tokens = prompts()[3][:40], prompts()[2][:8]
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt]), use_cache=True)
        logits = ours.step(prompt)[-1]
        assert logits.abs().max() < 2.0  # the cap (uncapped, they reach about 6)
        assert_logits_close(logits, ref.logits[0, -1])
        for token in new_tokens:
            ref = hf_model(torch.tensor([[token]]), past_key_values=ref.past_key_values, use_cache=True)
            assert_logits_close(ours.step([token])[-1], ref.logits[0, -1])


@pytest.mark.slow  # a whole model under Triton's interpreter; the kernels alone: tests/kernels
@pytest.mark.parametrize("family", CONFIGS)
def test_triton_path_gives_transformers_tokens(tmp_path: Path, family: str):
    """The CUDA path's kernels under the interpreter (soft-capped decode and prefill attention, both
    rotary tables through the fused RoPE), on one prompt longer than the window."""
    hf_model = save_tiny_model(CONFIGS[family](), tmp_path)
    assert_greedy_matches(str(tmp_path), hf_model, prompts()[2:3], attention_backend="triton")


def test_spec_reads_each_gemma_part(tmp_path: Path):
    hf_model = save_tiny_model(gemma3_config(), tmp_path)
    spec = load_spec(str(tmp_path))
    assert (spec.family, spec.hidden_act, spec.norm_weight_offset, spec.sandwich_norms, spec.scale_embeddings,
            spec.qk_norm, spec.attention_scale, spec.rope_theta, spec.rope_local_theta, spec.rope_scaling) == (
        "gemma3", "gelu_tanh", 1.0, True, True, True, 24**-0.5, 1_000_000.0, 100.0, LinearRope(8.0))
    assert spec.layer_windows == (WINDOW,) * 5 + (None,)
    assert spec.num_params() == sum(p.numel() for p in hf_model.parameters())
    save_tiny_model(gemma2_config(), tmp_path / "gemma2")
    spec = load_spec(str(tmp_path / "gemma2"))
    assert (spec.attn_logit_softcap, spec.final_logit_softcap, spec.layer_windows) == (1.0, 2.0, (WINDOW, None) * 2)


def test_gemma3_config_of_transformers_4_reads_the_same(tmp_path: Path):
    """Checkpoints saved before transformers 5 keep rope_theta, rope_scaling and rope_local_base_freq at
    the top level."""
    save_tiny_model(gemma3_config(), tmp_path)
    expected = load_spec(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    del config["rope_parameters"]
    config |= {"rope_theta": 1_000_000.0, "rope_local_base_freq": 100.0,
               "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_spec(str(tmp_path)) == expected


def llama_cpp_gemma_metadata(config, arch: gguf.MODEL_ARCH):
    """What llama.cpp's Gemma converters add to the shared metadata, and their norms stored plus one."""
    def add(writer: gguf.GGUFWriter) -> None:
        writer.add_sliding_window(config.sliding_window)
        if arch == gguf.MODEL_ARCH.GEMMA2:
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        else:
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(8.0)
    return add


@pytest.mark.parametrize(("family", "arch"), [("gemma2", gguf.MODEL_ARCH.GEMMA2), ("gemma3", gguf.MODEL_ARCH.GEMMA3)])
def test_gguf_gives_transformers_tokens(tmp_path: Path, family: str, arch):
    """llama.cpp's tensor names, its norms stored with Gemma's 1 added, its metadata: the attention scale
    and the sliding layers it infers (query_pre_attn_scalar is head_dim here, as llama.cpp assumes below
    27B; Gemma 3's local rope base is llama.cpp's fixed 10000)."""
    overrides = dict(query_pre_attn_scalar=16)
    if family == "gemma3":
        overrides["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                           "rope_theta": 1_000_000.0}}
    config = CONFIGS[family](**overrides)
    hf_model = save_tiny_model(config, tmp_path)
    path = tmp_path / f"tiny-{family}.gguf"
    write_gguf(hf_model, tmp_path, arch, path, norm_offset=1.0, extra_metadata=llama_cpp_gemma_metadata(config, arch))
    assert load_spec(str(path)).layer_windows == load_spec(str(tmp_path)).layer_windows
    assert_greedy_matches(str(path), hf_model, prompts())


def test_lookahead_is_refused_with_soft_capped_scores(tmp_path: Path):
    """Its guesses' attention (ops/tree_attention.py) has no soft cap: refused even where no window
    refuses it first."""
    save_tiny_model(gemma2_config(sliding_window=None, layer_types=None), tmp_path)
    with pytest.raises(InvalidRequestError, match="'lookahead' is not supported with .* soft-capped"):
        LLM(str(tmp_path), speculative_method="lookahead", **SETTINGS)


def test_native_decode_stack_is_not_given_gemma_layers(tmp_path: Path):
    """The CPU's one-call int4 decoder stack has none of Gemma's parts: the model stays on the per-op path
    (whose attention is the torch one: the native attention kernels have no soft cap)."""
    save_tiny_model(gemma2_config(intermediate_size=128, sliding_window=None, layer_types=None), tmp_path)
    llm = LLM(str(tmp_path), **(SETTINGS | {"quantization": "int4", "quantization_group_size": 32}))
    assert llm.engine.executor.worker.runner.model.native_decode is None
