"""Load a Hugging Face model directory: config.json, *.safetensors, tokenizer.json (hf_tokenizer.py).

Only safetensors are read: pickle checkpoints (*.bin, *.pt) can run arbitrary code when loaded, so
they are refused rather than unpickled. FP8 checkpoints load dequantized (hf_fp8.py); other quantized
ones are refused.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from goodserve.errors import ModelLoadError
from goodserve.model.families import Family, hf_family
from goodserve.model.hf_fp8 import Fp8Checkpoint, fp8_checkpoint
from goodserve.model.hf_tokenizer import hf_tokenizer, read_json
from goodserve.model.llama import LlamaForCausalLM, WeightFiller, build_empty_model
from goodserve.model.pipeline_parallel import PipelineParallel
from goodserve.model.spec import ModelSpec, SamplingDefaults
from goodserve.model.tensor_parallel import TensorParallel
from goodserve.model.tokenizer import Tokenizer
from goodserve.ops.rope_scaling import LinearRope, LongRope, RopeScaling

# Checkpoint projections that are row blocks of one fused parameter here (Phi-3's checkpoints
# store qkv_proj and gate_up_proj fused already, in the same order).
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up"),
}
# A mixture of experts' projections (Mixtral's w1/w3/w2, Qwen3-MoE's gate/up/down) -> the stacked
# parameter (model/moe.py) and the shard.
_EXPERT_PARAMS = {"w1": ("w13", "gate"), "gate_proj": ("w13", "gate"), "w3": ("w13", "up"),
                  "up_proj": ("w13", "up"), "w2": ("w2", "down"), "down_proj": ("w2", "down")}


def is_hf_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def hf_spec(config: dict[str, Any], name: str, generation_config: dict[str, Any],
            shape_only: bool = False) -> ModelSpec:
    """The model's spec; a setting goodserve does not implement is refused, unless shape_only (the
    calculators, which need the shapes of any architecture and never run it)."""
    family, family_fields = _family_of(config, shape_only)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    # transformers 5 nests rope settings in rope_parameters (per layer type where types differ: the
    # global layers' are the model's, families.py reads the others); older configs keep them top level.
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope = rope.get("full_attention", rope)
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
        rope_scaling=None if shape_only else _rope_scaling(rope, config),
        rms_norm_eps=float(config.get("rms_norm_eps", family.default_rms_norm_eps if family else 1e-5)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        family=family.name if family else "llama",
        **family_fields,
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=tuple(_as_list(generation_config.get("eos_token_id")) or _as_list(config.get("eos_token_id"))),
        sampling_defaults=SamplingDefaults.from_generation_config(generation_config),
        layer_windows=layer_windows(config),
    )


def _family_of(config: dict[str, Any], shape_only: bool) -> tuple[Family | None, dict[str, Any]]:
    """The checkpoint's family and the spec fields it sets; for shapes alone, an architecture goodserve
    cannot run (or a setting its family refuses) reads as a plain decoder of the same sizes."""
    try:
        family = hf_family((config.get("architectures") or ["<none>"])[0])
        return family, family.hf_fields(config)
    except ModelLoadError:
        if not shape_only:
            raise
        return None, {}


def layer_windows(config: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's sliding window. transformers names each layer's kind in layer_types
    ("sliding_attention" / "full_attention"); a config without them puts its window, if any, on every
    layer (Mistral, Mixtral, Phi-3) from max_window_layers on (Qwen2 / Qwen3 before transformers 5).
    Empty when no layer has one."""
    window, layers = config.get("sliding_window"), config["num_hidden_layers"]
    if window is None or config.get("use_sliding_window") is False:
        return ()
    first_sliding = config.get("max_window_layers") or 0
    kinds = config.get("layer_types") or [
        "sliding_attention" if i >= first_sliding else "full_attention" for i in range(layers)]
    windows = tuple(int(window) if kind == "sliding_attention" else None for kind in kinds)
    return windows if any(w is not None for w in windows) else ()


def _rope_scaling(rope: dict[str, Any], config: dict[str, Any]) -> RopeScaling | LinearRope | LongRope | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind in ("longrope", "su"):
        return _long_rope(rope, config)
    if kind == "linear":
        return LinearRope(factor=float(rope["factor"]))
    if kind != "llama3":
        raise ModelLoadError(f"rope scaling {kind!r} is not supported; supported: default, linear, llama3, longrope")
    return RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )


def _long_rope(rope: dict[str, Any], config: dict[str, Any]) -> LongRope:
    """Phi-3 keeps original_max_position_embeddings at the top level; its attention factor defaults
    to LongRoPE's sqrt(1 + ln(s) / ln(original)), s the context's growth (as transformers computes)."""
    original = int(rope.get("original_max_position_embeddings") or config["original_max_position_embeddings"])
    factor = rope.get("factor") or config["max_position_embeddings"] / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRope(short_factor=tuple(map(float, rope["short_factor"])), long_factor=tuple(map(float, rope["long_factor"])),
                    original_max_position_embeddings=original, attention_factor=float(attention_factor))


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


def _our_name(name: str) -> tuple[str, str | tuple[str, int] | None]:
    """The parameter a checkpoint tensor fills and its shard: a name of fused rows, or for an expert
    (shard name, expert index)."""
    if ".experts." in name:  # model.layers.3.mlp.experts.7.up_proj.weight, ...block_sparse_moe.experts.7.w3.weight
        layer_path, _, rest = name.partition(".experts.")
        expert, projection, _ = rest.split(".")
        param, shard = _EXPERT_PARAMS[projection]
        return f"{layer_path.replace('block_sparse_moe', 'mlp')}.experts.{param}", (shard, int(expert))
    if ".block_sparse_moe.gate." in name:  # Mixtral's router
        return name.replace("block_sparse_moe", "mlp"), None
    for theirs, (ours, shard) in _FUSED.items():
        if f".{theirs}." in name:
            return name.replace(theirs, ours), shard
    return name, None


def load_hf_weights(model: LlamaForCausalLM, files: list[Path], fp8: Fp8Checkpoint | None = None) -> None:
    """fp8: an FP8 checkpoint's scales, its weights dequantized as they load."""
    filler = WeightFiller(model)
    for file in files:
        try:
            _fill_from(filler, file, model.spec.tie_word_embeddings, fp8)
        except SafetensorError as e:  # a corrupt or truncated file: its header, or a tensor past its end
            raise ModelLoadError(f"{file} is not a readable safetensors file: {e} (download it again)") from e
    filler.finish()


def _fill_from(filler: WeightFiller, file: Path, tied: bool, fp8: Fp8Checkpoint | None) -> None:
    with safe_open(file, framework="pt") as f:
        for name in f.keys():
            if name.endswith("rotary_emb.inv_freq"):  # recomputed, stored by old checkpoints
                continue
            if name == "lm_head.weight" and tied:
                continue
            if fp8 is not None and fp8.is_scale(name):  # read with its weight
                continue
            tensor = f.get_tensor(name) if fp8 is None else fp8.dequantize(name, f.get_tensor(name))
            if ".qkv_proj." in name or ".gate_up_proj." in name:  # Phi-3's fused ones: split per shard
                filler.fill_whole(name, tensor)
                continue
            filler.fill(*_our_name(name), tensor)


def read_hf_spec(path: Path) -> ModelSpec:
    try:
        return hf_spec(read_json(path / "config.json"), path.name, read_json(path / "generation_config.json"))
    except KeyError as e:
        raise ModelLoadError(f"{path / 'config.json'} lacks the field {e}") from e


def load_hf(path: Path, dtype: torch.dtype, device: torch.device,
            tp: TensorParallel = TensorParallel(),
            pp: PipelineParallel = PipelineParallel(),
            quantization: str | None = None,
            group_size: int | None = None) -> tuple[ModelSpec, LlamaForCausalLM, Tokenizer | None]:
    spec = read_hf_spec(path)
    files = safetensors_files(path)
    fp8 = fp8_checkpoint(read_json(path / "config.json"), files)  # before any memory is taken
    tokenizer = hf_tokenizer(path, spec)
    model = build_empty_model(spec, dtype, device, tp, pp, quantization, group_size)
    load_hf_weights(model, files, fp8)
    return spec, model, tokenizer
