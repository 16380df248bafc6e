"""Load a Hugging Face model directory: config.json, *.safetensors, tokenizer.json (hf_tokenizer.py).

Only safetensors are read: pickle checkpoints (*.bin, *.pt) can run arbitrary code when loaded, so
they are refused rather than unpickled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from goodserve.errors import ModelLoadError
from goodserve.model.hf_tokenizer import hf_tokenizer, read_json
from goodserve.model.llama import LlamaForCausalLM, WeightFiller, build_empty_model
from goodserve.model.pipeline_parallel import PipelineParallel
from goodserve.model.spec import ModelSpec, SamplingDefaults
from goodserve.model.tensor_parallel import TensorParallel
from goodserve.model.tokenizer import Tokenizer
from goodserve.ops.rope_scaling import RopeScaling

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

# Checkpoint projections that are row blocks of one fused parameter here.
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up"),
}


def is_hf_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def hf_spec(config: dict[str, Any], name: str, generation_config: dict[str, Any],
            shape_only: bool = False) -> ModelSpec:
    """The model's spec; a setting goodserve does not implement is refused, unless shape_only (the
    calculators, which need the shapes of any architecture and never run it)."""
    arch = (config.get("architectures") or ["<none>"])[0]
    if not shape_only:
        _check_supported(config, arch)
    is_qwen2 = arch == "Qwen2ForCausalLM"
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    # transformers 5 nests rope settings in rope_parameters; older configs keep them top level.
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    return ModelSpec(
        name=name,
        vocab_size=config["vocab_size"],
        hidden_size=hidden,
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        rope_theta=float(theta),
        rope_scaling=None if shape_only else _rope_scaling(rope),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6 if is_qwen2 else 1e-5)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=is_qwen2,  # Qwen2 always has q/k/v biases
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=tuple(_as_list(generation_config.get("eos_token_id")) or _as_list(config.get("eos_token_id"))),
        sampling_defaults=SamplingDefaults.from_generation_config(generation_config),
        layer_windows=layer_windows(config),
    )


def _check_supported(config: dict[str, Any], arch: str) -> None:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"architecture {arch!r} is not supported; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if arch != "Qwen2ForCausalLM" and config.get("attention_bias"):
        raise ModelLoadError("attention_bias=True (a bias on o_proj too) is not supported")
    if config.get("mlp_bias"):
        raise ModelLoadError("mlp_bias=True is not supported")


def layer_windows(config: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's sliding window. transformers names each layer's kind in layer_types
    ("sliding_attention" / "full_attention"); a config without them (Mistral) puts its window, if any,
    on every layer. Empty when no layer has one."""
    window, layers = config.get("sliding_window"), config["num_hidden_layers"]
    if window is None or config.get("use_sliding_window") is False:
        return ()
    kinds = config.get("layer_types") or ["sliding_attention"] * layers
    windows = tuple(int(window) if kind == "sliding_attention" else None for kind in kinds)
    return windows if any(w is not None for w in windows) else ()


def _rope_scaling(rope: dict[str, Any]) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ModelLoadError(f"rope scaling {kind!r} is not supported; supported: default, llama3")
    return RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )


def _as_list(x: int | list[int] | None) -> list[int]:
    return [] if x is None else [x] if isinstance(x, int) else list(x)


def safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if pickles:
        raise ModelLoadError(
            f"{path} holds only pickle checkpoints ({', '.join(pickles[:3])}); goodserve loads safetensors "
            "only, since unpickling can run arbitrary code. Convert them (e.g. save_pretrained(..., "
            "safe_serialization=True)) and retry."
        )
    raise ModelLoadError(f"{path} has a config.json but no *.safetensors weights")


def _our_name(name: str) -> tuple[str, str | None]:
    for theirs, (ours, shard) in _FUSED.items():
        if f".{theirs}." in name:
            return name.replace(theirs, ours), shard
    return name, None


def load_hf_weights(model: LlamaForCausalLM, files: list[Path]) -> None:
    filler = WeightFiller(model)
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):  # recomputed, stored by old checkpoints
                    continue
                if name == "lm_head.weight" and model.spec.tie_word_embeddings:
                    continue
                filler.fill(*_our_name(name), f.get_tensor(name))
    filler.finish()


def read_hf_spec(path: Path) -> ModelSpec:
    try:
        return hf_spec(read_json(path / "config.json"), path.name, read_json(path / "generation_config.json"))
    except KeyError as e:
        raise ModelLoadError(f"{path / 'config.json'} lacks the field {e}") from e


def load_hf(path: Path, dtype: torch.dtype, device: torch.device,
            tp: TensorParallel = TensorParallel(),
            pp: PipelineParallel = PipelineParallel()) -> tuple[ModelSpec, LlamaForCausalLM, Tokenizer | None]:
    spec = read_hf_spec(path)
    files = safetensors_files(path)
    tokenizer = hf_tokenizer(path, spec)
    model = build_empty_model(spec, dtype, device, tp, pp)
    load_hf_weights(model, files)
    return spec, model, tokenizer
