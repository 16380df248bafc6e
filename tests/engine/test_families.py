"""Each model family beyond Llama, end to end against transformers: a tiny random-weight model made
with transformers' own config class and save_pretrained (float32), loaded by goodserve's engine; its
greedy tokens equal transformers' generate for 32 new tokens on four prompts of different lengths,
run batched (with small prefill chunks, so prompts span steps beside other sequences' decodes) and
one at a time. GGUF files of the families that have a llama.cpp architecture are written with the
gguf package's writer, in llama.cpp's tensor names and layout, and give the same tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors.torch
import torch

from helpers import loaded_model

from goodserve.config import KernelOptions
from goodserve.diagnose.calc import decode_weight_bytes
from goodserve.errors import InvalidRequestError, ModelLoadError
from goodserve.llm import LLM
from goodserve.model.loader import load_model, load_spec
from goodserve.model.presets import get_preset
from goodserve.sampling_params import SamplingParams
from test_model_hf import PagedSequence, assert_logits_close

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
MOE = dict(num_experts_per_tok=2)
FAMILIES = {
    # head_dim 32 with hidden 64: q_size (128) differs from hidden, as in Qwen3's own shapes.
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=32),
    "mixtral": lambda: transformers.MixtralConfig(**TINY, num_local_experts=4, **MOE),
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(**TINY, num_experts=4, moe_intermediate_size=48,
                                                     norm_topk_prob=False, **MOE),
    "qwen3-moe-norm-topk": lambda: transformers.Qwen3MoeConfig(**TINY, num_experts=4, moe_intermediate_size=48,
                                                               norm_topk_prob=True, **MOE),
    "phi3": lambda: transformers.Phi3Config(**TINY, original_max_position_embeddings=512),
}
PROMPT_LENGTHS = (3, 17, 40, 75)
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
SETTINGS = {"dtype": "float32", "quantization": "none", "num_kv_blocks": 64, "max_num_batched_tokens": 32}


def prompts(vocab_size: int = 300) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def save_tiny_model(config, path: Path):
    """Random weights, norms included (their init of ones would hide a norm read from the wrong tensor)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_greedy(model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def assert_greedy_matches(model_name: str, hf_model, prompt_ids: list[list[int]], **settings) -> LLM:
    expected = [hf_greedy(hf_model, p) for p in prompt_ids]
    llm = LLM(model_name, **(SETTINGS | settings))
    batched = [out.outputs[0].token_ids for out in llm.generate([{"prompt_token_ids": p} for p in prompt_ids], GREEDY)]
    alone = [llm.generate({"prompt_token_ids": p}, GREEDY)[0].outputs[0].token_ids for p in prompt_ids]
    assert batched == expected
    assert alone == expected
    return llm


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers(tmp_path: Path, family: str):
    hf_model = save_tiny_model(FAMILIES[family](), tmp_path)
    assert_greedy_matches(str(tmp_path), hf_model, prompts())


WINDOWED = {  # a window of 16 that the longer prompts outgrow; Qwen3's on its second layer only
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=32, use_sliding_window=True, sliding_window=16,
                                              max_window_layers=1),
    "mixtral": lambda: transformers.MixtralConfig(**TINY, num_local_experts=4, sliding_window=16, **MOE),
    "phi3": lambda: transformers.Phi3Config(**TINY, original_max_position_embeddings=512, sliding_window=16),
}


@pytest.mark.parametrize("family", WINDOWED)
def test_sliding_window_greedy_tokens_match_transformers(tmp_path: Path, family: str):
    hf_model = save_tiny_model(WINDOWED[family](), tmp_path)
    expected = (None, 16) if family == "qwen3" else (16, 16)
    assert load_spec(str(tmp_path)).layer_windows == expected
    assert_greedy_matches(str(tmp_path), hf_model, prompts())


def test_qwen3_config_without_layer_types_slides_from_max_window_layers(tmp_path: Path):
    """Configs saved before transformers 5 name no layer types: Qwen's window starts at max_window_layers."""
    save_tiny_model(WINDOWED["qwen3"](), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["layer_types"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_spec(str(tmp_path)).layer_windows == (None, 16)


def long_rope_phi3(path: Path):
    """A 128k-style Phi-3 whose original context is 64 positions."""
    factors = torch.Generator().manual_seed(3)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": (1 + torch.rand(8, generator=factors)).tolist(),
            "long_factor": (1 + 8 * torch.rand(8, generator=factors)).tolist()}
    return save_tiny_model(transformers.Phi3Config(**TINY, original_max_position_embeddings=64, rope_parameters=rope),
                           path)


def test_phi3_long_rope_within_the_original_context_matches_transformers(tmp_path: Path):
    hf_model = long_rope_phi3(tmp_path)
    spec = load_spec(str(tmp_path))
    assert spec.rope_scaling.original_max_position_embeddings == 64 and spec.rope_scaling.attention_factor > 1
    assert_greedy_matches(str(tmp_path), hf_model, [p[:n] for p, n in zip(prompts(), (3, 9, 17, 31))])


def test_phi3_long_rope_past_the_original_context_matches_transformers_forward(tmp_path: Path):
    """Past the original context each new token rotates by the long factors, as transformers' forward
    with a cache does; the keys already cached keep theirs. (transformers' generate instead recomputes
    the whole sequence once when it crosses, rotating every position by the long factors; a paged
    cache keeps each position's rotation, so a prefix-cached block means one thing whatever follows.)"""
    hf_model = long_rope_phi3(tmp_path)
    loaded = load_model(str(tmp_path), torch.float32, "cpu")
    prompt = prompts()[3][:60]
    new_tokens = prompts()[2][:30]  # teacher-forced from position 60 to 89
    ours = PagedSequence(loaded.model, num_blocks=8)
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt]), use_cache=True)
        assert_logits_close(ours.step(prompt)[-1], ref.logits[0, -1])
        for token in new_tokens:
            ref = hf_model(torch.tensor([[token]]), past_key_values=ref.past_key_values, use_cache=True)
            assert_logits_close(ours.step([token])[-1], ref.logits[0, -1])


def llama_cpp_permute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotary halves interleaved in pairs."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


def llama_cpp_tensors(checkpoint: Path, config, permute: bool) -> dict[str, torch.Tensor]:
    """The saved checkpoint as llama.cpp's converter writes it (HF names still): each projection of
    all experts stacked into one [E, rows, cols] tensor, q/k rows permuted for the Llama lineage only."""
    tensors, experts = {}, {}
    for name, tensor in safetensors.torch.load_file(checkpoint / "model.safetensors").items():
        if ".experts." in name:  # model.layers.0.mlp.experts.3.up_proj.weight
            stem, _, rest = name.partition(".experts.")
            expert, projection, _ = rest.split(".")
            experts.setdefault(f"{stem}.experts.{projection}.weight", {})[int(expert)] = tensor
            continue
        if permute and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            tensor = llama_cpp_permute(tensor, heads)
        tensors[name] = tensor
    return tensors | {name: torch.stack([by_index[e] for e in sorted(by_index)]) for name, by_index in experts.items()}


def write_gguf(hf_model, checkpoint: Path, arch: gguf.MODEL_ARCH, path: Path, norm_offset: float = 0.0,
               extra_metadata=lambda writer: None) -> None:
    """The saved checkpoint as llama.cpp's converter writes it: its tensor names (gguf's own name
    map), float32, its metadata, a stand-in vocabulary. norm_offset: added to every norm weight (as
    llama.cpp's Gemma converters do); extra_metadata(writer) adds an architecture's own keys."""
    config, name = hf_model.config, gguf.MODEL_ARCH_NAMES[arch]
    writer = gguf.GGUFWriter(str(path), name)
    extra_metadata(writer)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.rope_parameters
    rope = rope.get("full_attention", rope)  # per layer type (Gemma 3): the global layers' is the file's
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "num_experts_per_tok", None):
        writer.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if getattr(config, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if rope.get("rope_type") == "longrope":  # as llama.cpp's Phi-3 converter: factors as tensors
        original = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(config.max_position_embeddings / original) / math.log(original)))
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))
    tokens = [chr(0x100 + i) for i in range(config.vocab_size)]  # prompts are token ids: any distinct strings
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for hf_name, tensor in llama_cpp_tensors(checkpoint, config, permute=arch == gguf.MODEL_ARCH.LLAMA).items():
        if "norm" in hf_name:
            tensor = tensor + norm_offset
        writer.add_tensor(names.get_name(hf_name, try_suffixes=(".weight",)), tensor.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_phi3_gguf_gives_transformers_tokens(tmp_path: Path):
    """Fused attn_qkv and ffn_up (gate and up), LongRoPE's factors as tensors."""
    hf_model = long_rope_phi3(tmp_path)
    path = tmp_path / "tiny-phi3.gguf"
    write_gguf(hf_model, tmp_path, gguf.MODEL_ARCH.PHI3, path)
    ours, theirs = load_spec(str(path)).rope_scaling, load_spec(str(tmp_path)).rope_scaling
    assert ours.original_max_position_embeddings == theirs.original_max_position_embeddings == 64
    assert ours.attention_factor == pytest.approx(theirs.attention_factor)  # stored as float32
    assert (ours.short_factor, ours.long_factor) == (pytest.approx(theirs.short_factor), pytest.approx(theirs.long_factor))
    assert_greedy_matches(str(path), hf_model, [p[:n] for p, n in zip(prompts(), (3, 9, 17, 31))])


@pytest.mark.parametrize(("family", "arch"), [("mixtral", gguf.MODEL_ARCH.LLAMA),  # llama.cpp's Mixtral
                                              ("qwen3-moe-norm-topk", gguf.MODEL_ARCH.QWEN3MOE)])
def test_moe_gguf_gives_transformers_tokens(tmp_path: Path, family: str, arch):
    hf_model = save_tiny_model(FAMILIES[family](), tmp_path)
    path = tmp_path / "tiny-moe.gguf"
    write_gguf(hf_model, tmp_path, arch, path)
    spec = load_spec(str(path))
    assert (spec.num_experts, spec.num_experts_per_tok) == (4, 2)
    assert_greedy_matches(str(path), hf_model, prompts())


def test_qwen3_gguf_gives_transformers_tokens(tmp_path: Path):
    hf_model = save_tiny_model(FAMILIES["qwen3"](), tmp_path)
    path = tmp_path / "tiny-qwen3.gguf"
    write_gguf(hf_model, tmp_path, gguf.MODEL_ARCH.QWEN3, path)
    assert load_spec(str(path)).qk_norm
    assert_greedy_matches(str(path), hf_model, prompts())


@pytest.mark.slow  # a whole model under Triton's interpreter; the kernels alone: tests/kernels
@pytest.mark.parametrize("kernels", [KernelOptions(), KernelOptions(moe_norm_router=True)],
                         ids=["default", "norm-router"])
def test_triton_path_gives_transformers_tokens(tmp_path: Path, kernels: KernelOptions):
    """The CUDA path's kernels (the fused MoE, the q/k norms' in-place kernel; with moe_norm_router the
    norm before each MoE inside its router's launch) under the interpreter, on one prompt (a minute or
    more: every kernel runs in Python)."""
    hf_model = save_tiny_model(FAMILIES["qwen3-moe-norm-topk"](), tmp_path)
    assert_greedy_matches(str(tmp_path), hf_model, prompts()[1:2], attention_backend="triton", kernels=kernels)


def test_spec_reads_each_familys_parts(tmp_path: Path):
    save_tiny_model(FAMILIES["qwen3-moe"](), tmp_path)
    spec = load_spec(str(tmp_path))
    assert (spec.family, spec.qk_norm, spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size,
            spec.norm_topk_prob, spec.head_dim) == ("qwen3-moe", True, 4, 2, 48, False, 16)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert spec.num_params() == sum(p.numel() for p in hf_model.parameters())


@pytest.mark.parametrize("method", ["ngram", "lookahead"])
@pytest.mark.parametrize("family", ["qwen3", "mixtral", "phi3"])
def test_speculative_decoding_keeps_transformers_tokens(tmp_path: Path, family: str, method: str):
    hf_model = save_tiny_model(FAMILIES[family](), tmp_path)
    # Prompts that repeat themselves, so prompt lookup finds drafts to verify.
    llm = assert_greedy_matches(str(tmp_path), hf_model, [p * 2 for p in prompts()[:3]], speculative_method=method,
                                spec_policy="always")
    stats = llm.engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens > 0


def test_native_decode_stack_is_not_given_q_k_norms(tmp_path: Path):
    """The CPU's one-call int4 decoder stack has no q/k norms: a Qwen3 model stays on the per-op path."""
    config = FAMILIES["qwen3"]()
    config.intermediate_size = 128  # int4 groups of 32
    save_tiny_model(config, tmp_path)
    llm = LLM(str(tmp_path), **(SETTINGS | {"quantization": "int4", "quantization_group_size": 32}))
    assert loaded_model(llm).native_decode is None


def test_dummy_moe_preset_gives_the_same_tokens_batched_and_alone():
    llm = LLM("dummy:tiny-moe", **SETTINGS)
    ids = prompts(512)
    batched = [out.outputs[0].token_ids for out in llm.generate([{"prompt_token_ids": p} for p in ids], GREEDY)]
    assert batched == [llm.generate({"prompt_token_ids": p}, GREEDY)[0].outputs[0].token_ids for p in ids]


@pytest.mark.parametrize(("preset", "total", "active"), [
    ("qwen3-30b-a3b", 30.5e9, 3.3e9),  # the model card's figures
    ("mixtral-8x7b", 46.7e9, 12.9e9),  # Mistral's announcement
])
def test_moe_presets_count_active_parameters(preset: str, total: float, active: float):
    spec = get_preset(preset)
    assert spec.num_params() == pytest.approx(total, rel=0.01)
    assert spec.num_active_params() == pytest.approx(active, rel=0.02)
    # A batch-1 decode step reads the active weights; a large batch routes to every expert. Either reads
    # one row a token of the (untied) embedding table, not the table.
    table = spec.vocab_size * spec.hidden_size
    assert decode_weight_bytes(spec, "bf16", batch=1) == pytest.approx(2 * (spec.num_active_params() - table))
    assert decode_weight_bytes(spec, "bf16", batch=4096) == pytest.approx(2 * (spec.num_params() - table))


def test_calc_and_diagnose_report_active_parameters(capsys):
    from goodserve.cli import main

    assert main(["calc", "kv", "--model", "qwen3-30b-a3b", "--seq-len", "4096"]) == 0
    assert "8 of 128 experts per token, 3.35 B of 30.53 B parameters active" in capsys.readouterr().out
    assert main(["diagnose", "--model", "qwen3-30b-a3b", "--hardware", "h100"]) == 0
    assert "3.353 B active per token" in capsys.readouterr().out


def test_unsupported_architecture_is_refused_with_the_supported_list(tmp_path: Path):
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="'GPT2LMHeadModel' is not supported; supported architectures: "
                                             "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                                             "MixtralForCausalLM, Qwen3MoeForCausalLM, Phi3ForCausalLM, "
                                             "Gemma2ForCausalLM, Gemma3ForCausalLM$"):
        load_spec(str(tmp_path))


def test_unsupported_gguf_architecture_is_refused_with_the_supported_list(tmp_path: Path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="GGUF architecture 'gpt2' is not supported; supported architectures: "
                                             "llama, mistral, qwen2, qwen3, qwen3moe, phi3, gemma2, gemma3$"):
        load_spec(str(path))


@pytest.mark.parametrize(("family", "setting", "message"), [
    ("qwen3", {"attention_bias": True}, "attention_bias=True"),
    ("qwen3-moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
])
def test_settings_a_family_lacks_are_refused(tmp_path: Path, family: str, setting: dict, message: str):
    config = FAMILIES[family]()
    for key, value in setting.items():
        setattr(config, key, value)
    config.architectures = [transformers.AutoModelForCausalLM._model_mapping[type(config)].__name__]
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=message):
        load_spec(str(tmp_path))


@pytest.mark.parametrize(("settings", "message"), [
    ({"quantization": "int4", "quantization_group_size": 32}, "does not divide the experts' down projection's input dimension 112"),
    ({"quantization": "int4"}, "does not divide the experts' down projection's input dimension 112"),  # no size divides 112 and 64
    ({"quantization": "int8", "quantization_awq": True}, "quantization_awq is not supported"),
])
def test_moe_refuses_what_it_cannot_combine_with(tmp_path: Path, settings: dict, message: str):
    save_tiny_model(FAMILIES["mixtral"](), tmp_path)
    with pytest.raises(InvalidRequestError, match=message):
        LLM(str(tmp_path), **(SETTINGS | settings))
