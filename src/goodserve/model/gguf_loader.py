"""Load a GGUF file (llama.cpp's format): model shape, weights and tokenizer (gguf_tokenizer.py) all
come from it.

Quantized tensors are dequantized to the target dtype at load, unless `keep_quantization` asks
for the file's own quantization (`--quantization gguf`): then every linear whose tensors are all
Q4_0, Q4_1 or Q8_0 keeps their codes (quant/gguf_native.py), the rest is dequantized as usual;
the embedding lookup always reads a float table. llama.cpp's converter permutes the rows of
attn_q / attn_k so its rotary code can rotate adjacent pairs; we rotate halves (the Hugging Face
layout), so the permutation is undone (on codes, scales and zeros alike: whole rows move), exactly
as transformers' GGUF loader does. Its Gemma converters store every norm weight with Gemma's offset
of 1 added (so llama.cpp scales by the weight); it is taken off again here.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from goodserve.errors import InvalidRequestError, ModelLoadError
from goodserve.model.families import gguf_family
from goodserve.model.gguf_reader import eos_token_ids, metadata, open_gguf
from goodserve.model.gguf_tokenizer import gguf_tokenizer
from goodserve.model.llama import LlamaForCausalLM, WeightFiller, build_empty_model
from goodserve.model.pipeline_parallel import PipelineParallel
from goodserve.model.spec import ModelSpec
from goodserve.model.tensor_parallel import TensorParallel, is_row_parallel
from goodserve.model.tokenizer import Tokenizer
from goodserve.ops.rope_scaling import LinearRope, LongRope, RopeScaling
from goodserve.ops.rotary import inverse_frequencies
from goodserve.quant import gguf_native
from goodserve.quant.apply import TARGET_LINEARS

# GGUF tensor name suffix -> (our parameter name, shard of a fused parameter or None).
_LAYER_TENSORS = {
    "attn_norm.weight": ("input_layernorm.weight", None),
    "ffn_norm.weight": ("post_attention_layernorm.weight", None),
    "attn_q.weight": ("self_attn.qkv_proj.weight", "q"),
    "attn_k.weight": ("self_attn.qkv_proj.weight", "k"),
    "attn_v.weight": ("self_attn.qkv_proj.weight", "v"),
    "attn_q.bias": ("self_attn.qkv_proj.bias", "q"),
    "attn_k.bias": ("self_attn.qkv_proj.bias", "k"),
    "attn_v.bias": ("self_attn.qkv_proj.bias", "v"),
    "attn_qkv.weight": ("self_attn.qkv_proj.weight", None),  # Phi-3: q, k, v fused as here
    "attn_output.weight": ("self_attn.o_proj.weight", None),
    "attn_q_norm.weight": ("self_attn.q_norm.weight", None),
    "attn_k_norm.weight": ("self_attn.k_norm.weight", None),
    "ffn_gate.weight": ("mlp.gate_up_proj.weight", "gate"),
    "ffn_up.weight": ("mlp.gate_up_proj.weight", "up"),
    "ffn_down.weight": ("mlp.down_proj.weight", None),
    # A mixture of experts: the router, and each projection of all experts stacked [E, rows, cols].
    "ffn_gate_inp.weight": ("mlp.gate.weight", None),
    "ffn_gate_exps.weight": ("mlp.experts.w13", "gate"),
    "ffn_up_exps.weight": ("mlp.experts.w13", "up"),
    "ffn_down_exps.weight": ("mlp.experts.w2", "down"),
}
_GLOBAL_TENSORS = {
    "token_embd.weight": ("model.embed_tokens.weight", None),
    "output_norm.weight": ("model.norm.weight", None),
    "output.weight": ("lm_head.weight", None),
}
# Folded into ModelSpec.rope_scaling.
# Gemma's norms (sandwich_norms): its MLP's input norm is ffn_norm, its sublayers' outputs have their own.
_SANDWICH_NORMS = {
    "ffn_norm.weight": ("pre_feedforward_layernorm.weight", None),
    "post_attention_norm.weight": ("post_attention_layernorm.weight", None),
    "post_ffw_norm.weight": ("post_feedforward_layernorm.weight", None),
}
_IGNORED_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_FUSED_PARAMS = (".qkv_proj.weight", ".gate_up_proj.weight")


def gguf_spec(reader: gguf.GGUFReader, name: str) -> ModelSpec:
    arch = metadata(reader, "general.architecture")
    family = gguf_family(arch)
    tensors = {t.name: t for t in reader.tensors}
    key = lambda k, default=None: metadata(reader, f"{arch}.{k}", default)  # noqa: E731
    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden // heads
    theta = float(key("rope.freq_base", 10000.0))
    bos = metadata(reader, "tokenizer.ggml.bos_token_id")
    return ModelSpec(
        name=name,
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # GGML shapes are [cols, rows]
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length", 0),
        num_layers=key("block_count"),
        num_heads=heads,
        num_kv_heads=key("attention.head_count_kv", heads),
        head_dim=head_dim,
        max_position_embeddings=key("context_length"),
        rope_theta=theta,
        rope_scaling=(_long_rope(tensors, key) or _linear_rope(key)
                      or _rope_scaling(tensors.get("rope_freqs.weight"), head_dim, theta)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", family.default_rms_norm_eps)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        family=family.name,
        **family.gguf_fields(key),
        bos_token_id=bos,
        eos_token_ids=tuple(eos_token_ids(reader)),
    )


def _rope_scaling(rope_freqs, head_dim: int, theta: float) -> RopeScaling | None:
    """Llama-3 GGUFs store the per-frequency divisors, not the parameters; recover them.

    Every Llama 3.x model uses low/high frequency factors 1 and 4 over 8192 original positions;
    only `factor` varies, and it is the largest divisor. We check the fit rather than trust it.
    """
    if rope_freqs is None:
        return None
    divisors = torch.from_numpy(_dequantize(rope_freqs).astype(np.float32).reshape(-1))
    scaling = RopeScaling(factor=float(divisors.max()), low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)
    expected = inverse_frequencies(head_dim, theta, None) / inverse_frequencies(head_dim, theta, scaling)
    if not torch.allclose(divisors, expected, rtol=1e-3):
        raise ModelLoadError("this GGUF's rope_freqs do not follow Llama-3 rope scaling; not supported")
    return scaling


def _long_rope(tensors: dict, key) -> LongRope | None:
    """Phi-3's LongRoPE: llama.cpp stores its factors as tensors and its attention factor (the one
    transformers derives) as metadata."""
    if "rope_factors_long.weight" not in tensors:
        return None
    factors = {kind: tuple(_dequantize(tensors[f"rope_factors_{kind}.weight"]).reshape(-1).tolist())
               for kind in ("short", "long")}
    return LongRope(short_factor=factors["short"], long_factor=factors["long"],
                    original_max_position_embeddings=key("rope.scaling.original_context_length"),
                    attention_factor=float(key("rope.scaling.attn_factor", 1.0)))


def _linear_rope(key) -> LinearRope | None:
    kind = key("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ModelLoadError(f"GGUF rope scaling {kind!r} is not supported; supported: linear")
    return LinearRope(factor=float(key("rope.scaling.factor")))


def _dequantize(tensor) -> np.ndarray:
    """A GGUF tensor as a float array in PyTorch's [rows, cols] order."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)


def _unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's permute(): within each head, rows were interleaved (pairs) from halves."""
    rows_per_half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, rows_per_half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _our_name(gguf_name: str, sandwich_norms: bool) -> tuple[str, str | None] | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")  # "blk.3.attn_q.weight"
    layer, _, suffix = rest.partition(".")
    names = _LAYER_TENSORS | _SANDWICH_NORMS if sandwich_norms else _LAYER_TENSORS
    if prefix == "blk" and suffix in names:
        param, shard = names[suffix]
        return f"model.layers.{layer}.{param}", shard
    return None


def _targets(tensor, spec: ModelSpec, own_lm_head: bool) -> list[tuple[str, str | None]]:
    """Our (parameter, shard) names a GGUF tensor fills. A tied token_embd is also lm_head's weight,
    which needs its own copy only where lm_head keeps the file's codes (own_lm_head)."""
    if tensor.name in _IGNORED_TENSORS:
        return []
    target = _our_name(tensor.name, spec.sandwich_norms)
    if target is None:
        raise ModelLoadError(f"unexpected tensor {tensor.name!r} in GGUF file")
    if target[1] == "up" and int(tensor.shape[1]) == 2 * spec.intermediate_size:  # Phi-3's gate and up, fused
        target = (target[0], None)
    tied_head = tensor.name == "token_embd.weight" and spec.tie_word_embeddings and own_lm_head
    return [target, ("lm_head.weight", None)] if tied_head else [target]


def _keep_native_linears(model: LlamaForCausalLM, reader: gguf.GGUFReader) -> dict[str, nn.Module]:
    """Swap in a native layer for each projection (and lm_head) whose GGUF tensors share one of
    gguf_native.NATIVE_TYPES; returns them by module path."""
    types: dict[str, set] = {}
    for tensor in reader.tensors:
        for name, _ in _targets(tensor, model.spec, own_lm_head=True):
            types.setdefault(name.removesuffix(".weight"), set()).add(tensor.tensor_type)
    native = {}
    for path, found in types.items():
        parent_path, _, attr = path.rpartition(".")
        if (not model.pp.holds(f"{path}.weight", model.spec) or attr not in (*TARGET_LINEARS, "lm_head")
                or len(found) != 1 or next(iter(found)) not in gguf_native.NATIVE_TYPES):
            continue
        parent = model.get_submodule(parent_path)
        _check_split(path, next(iter(found)), getattr(parent, attr), model.tp)
        # lm_head tied to the embedding: its float table serves many-row (prefill) calls as before.
        table = model.model.embed_tokens.weight if attr == "lm_head" and model.spec.tie_word_embeddings else None
        native[path] = gguf_native.native_linear(found.pop(), getattr(parent, attr), table)
        setattr(parent, attr, native[path])
    return native


def _check_split(path: str, tensor_type, linear: nn.Linear, tp: TensorParallel) -> None:
    """A row-parallel layer's shard must hold whole blocks of 32 inputs, and a Q8_0 one's codes
    (two int4 halves side by side, gguf_native.Int8GroupLinear) are not sliced per half."""
    if tp.size == 1 or not is_row_parallel(path + "."):
        return
    if tensor_type == gguf_native.Q8_0 or linear.in_features % gguf_native.GROUP_SIZE:
        raise InvalidRequestError(
            f"--tensor-parallel-size {tp.size} cannot split the GGUF codes of {path} ({tensor_type.name}, "
            f"{linear.in_features} inputs a rank; Q4_0 / Q4_1 split on blocks of {gguf_native.GROUP_SIZE}): "
            f"use --quantization none (or int8 / int4) or another size")


def load_gguf_weights(model: LlamaForCausalLM, reader: gguf.GGUFReader, arch: str,
                      keep_quantization: bool = False) -> None:
    spec = model.spec
    native = _keep_native_linears(model, reader) if keep_quantization else {}
    codes = {f"{path}.{name}": getattr(gguf_native.int4_storage(module), name)
             for path, module in native.items() for name in ("qweight", "scales", "zeros")}
    filler = WeightFiller(model, codes)
    permuted = gguf_family(arch).gguf_permutes_qk
    for tensor in reader.tensors:
        float_weight = None
        for name, shard in _targets(tensor, spec, own_lm_head="lm_head" in native):
            path = name.removesuffix(".weight")
            unpermute = permuted and shard in ("q", "k")
            heads = spec.num_heads if shard == "q" else spec.num_kv_heads
            if path in native:
                w = gguf_native.block_codes(tensor.data, tensor.tensor_type)
                for part, values in (("qweight", w.qweight), ("scales", w.scales), ("zeros", w.zeros)):
                    filler.fill(f"{path}.{part}", shard, _unpermute_rows(values, heads) if unpermute else values)
                continue
            if float_weight is None:
                float_weight = torch.from_numpy(np.require(_dequantize(tensor), np.float32, ["C", "W"]))
                if "norm" in name:
                    float_weight -= spec.norm_weight_offset
            if ".experts." in name:  # one shard per expert
                for expert, rows in enumerate(float_weight):
                    filler.fill(name, (shard, expert), rows)
                continue
            if shard is None and name.endswith(_FUSED_PARAMS):  # fused in the file too
                filler.fill_whole(name, float_weight)
                continue
            filler.fill(name, shard, _unpermute_rows(float_weight, heads) if unpermute else float_weight)
    filler.finish()


def architecture(reader: gguf.GGUFReader) -> str:
    return metadata(reader, "general.architecture")


def load_gguf(path: Path, dtype: torch.dtype, device: torch.device, keep_quantization: bool = False,
              tp: TensorParallel = TensorParallel(),
              pp: PipelineParallel = PipelineParallel(),
              quantization: str | None = None,
              group_size: int | None = None) -> tuple[ModelSpec, LlamaForCausalLM, Tokenizer]:
    reader = open_gguf(path)
    spec = gguf_spec(reader, name=path.stem)
    tokenizer = gguf_tokenizer(reader)
    model = build_empty_model(spec, dtype, device, tp, pp, quantization, group_size)
    load_gguf_weights(model, reader, architecture(reader), keep_quantization)
    return spec, model, tokenizer
