"""The model families goodserve runs, and the one registry that maps a checkpoint's architecture name
(config.json's `architectures`, a GGUF file's `general.architecture`) to one of them.

A family is not a model class: every family runs model/llama.py's decoder, assembled from shared
parts by its ModelSpec (attention with or without q/k norms, q/k/v biases, a sliding window and
soft-capped scores; the gated MLP, SwiGLU or GeGLU, or the mixture of experts of model/moe.py;
RMSNorm, Gemma's scaled by 1 + weight and after each sublayer too; rotary tables with their
scaling). A family says which
of those parts its checkpoints need, reads the fields that choose them from a config, and refuses
any setting it does not implement (a model that would run with it ignored would answer wrongly).
The loaders (hf_loader.py, gguf_loader.py) read the fields every family shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from goodserve.errors import ModelLoadError

# Reads a GGUF metadata key under the file's architecture prefix: key("expert_count", default).
GgufKey = Callable[..., Any]


@dataclass(frozen=True)
class Family:
    name: str
    hf_architectures: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    # config.json -> the ModelSpec fields that pick this family's parts (refusing what it lacks).
    hf_fields: Callable[[dict[str, Any]], dict[str, Any]]
    # The same from a GGUF file's metadata.
    gguf_fields: Callable[[GgufKey], dict[str, Any]] = lambda key: {}
    default_rms_norm_eps: float = 1e-5
    # llama.cpp's converter permutes attn_q / attn_k rows for its rotary layout (convert_hf_to_gguf's
    # LlamaModel.permute) only for the Llama lineage; Qwen's and Phi's tensors are written as they are.
    gguf_permutes_qk: bool = False


def _no_bias(config: dict[str, Any], family: str) -> None:
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ModelLoadError(f"{family}: {key}=True is not supported")


def _llama(config: dict[str, Any]) -> dict[str, Any]:
    _no_bias(config, "llama")
    return {}


def _gguf_experts(key: GgufKey) -> dict[str, Any]:
    """A mixture of experts' fields from llama.cpp's metadata (none for a dense model). llama.cpp
    renormalises the routed experts' weights for Mixtral and Qwen3-MoE alike."""
    if not key("expert_count", 0):
        return {}
    return {"num_experts": key("expert_count"), "num_experts_per_tok": key("expert_used_count"),
            "moe_intermediate_size": key("expert_feed_forward_length") or key("feed_forward_length"),
            "norm_topk_prob": True}


def _qwen2(config: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": True}  # Qwen2 always has q/k/v biases


def _qwen3(config: dict[str, Any]) -> dict[str, Any]:
    _no_bias(config, "qwen3")  # its attention_bias would put one on o_proj too
    return {"qk_norm": True}


def _mixtral(config: dict[str, Any]) -> dict[str, Any]:
    return {"num_experts": config["num_local_experts"], "num_experts_per_tok": config["num_experts_per_tok"],
            "moe_intermediate_size": config["intermediate_size"], "norm_topk_prob": True}


def _qwen3_moe(config: dict[str, Any]) -> dict[str, Any]:
    fields = _qwen3(config)
    if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
        raise ModelLoadError("qwen3-moe: dense layers between the sparse ones (decoder_sparse_step, "
                             "mlp_only_layers) are not supported")
    experts = config.get("num_experts") or config["num_local_experts"]  # transformers 5 renamed it
    return fields | {"num_experts": experts, "num_experts_per_tok": config["num_experts_per_tok"],
                     "moe_intermediate_size": config["moe_intermediate_size"],
                     "norm_topk_prob": bool(config.get("norm_topk_prob", False))}


def _gemma(config: dict[str, Any], family: str) -> dict[str, Any]:
    """What Gemma 2 and 3 share: GeGLU, norms scaled by 1 + weight before and after each sublayer,
    embeddings scaled by sqrt(hidden), the attention scale from query_pre_attn_scalar, and the soft
    caps where set (Gemma 2 sets both; Gemma 3's configs carry them as None)."""
    _no_bias(config, family)
    activation = config.get("hidden_activation") or config.get("hidden_act")
    if activation != "gelu_pytorch_tanh":
        raise ModelLoadError(f"{family}: hidden_activation {activation!r} is not supported; supported: "
                             "gelu_pytorch_tanh")
    return {"hidden_act": "gelu_tanh", "norm_weight_offset": 1.0, "sandwich_norms": True, "scale_embeddings": True,
            "query_pre_attn_scalar": float(config.get("query_pre_attn_scalar") or config["head_dim"]),
            "attn_logit_softcap": _float_or_none(config.get("attn_logit_softcapping")),
            "final_logit_softcap": _float_or_none(config.get("final_logit_softcapping"))}


def _float_or_none(x: float | None) -> float | None:
    return None if x is None else float(x)


def _gemma2(config: dict[str, Any]) -> dict[str, Any]:
    return _gemma(config, "gemma2")


def _gemma3(config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 adds q/k norms and its sliding layers' own rotary base: rope_local_base_freq, or under
    transformers 5 the sliding_attention entry of rope_parameters (which then holds one entry per
    layer type; hf_loader reads the full_attention one as the model's rope)."""
    local = (config.get("rope_parameters") or {}).get("sliding_attention")
    if local is not None and local.get("rope_type", "default") != "default":
        raise ModelLoadError(f"gemma3: rope scaling {local['rope_type']!r} on the sliding layers is not supported")
    theta = local["rope_theta"] if local is not None else config.get("rope_local_base_freq", 10000.0)
    return _gemma(config, "gemma3") | {"qk_norm": True, "rope_local_theta": float(theta)}


def _gguf_gemma(key: GgufKey, sliding_period: int, layers_of_27b: int) -> dict[str, Any]:
    """Gemma's parts from llama.cpp's metadata. llama.cpp stores neither query_pre_attn_scalar nor which
    layers slide: it scales by head_dim**-0.5 except on the 27B models (hidden / heads there), which it
    knows by their layer count, and makes every `sliding_period`-th layer global, the others local."""
    layers, hidden, heads = key("block_count"), key("embedding_length"), key("attention.head_count")
    scalar = hidden / heads if layers == layers_of_27b else key("attention.key_length") or hidden // heads
    window = key("attention.sliding_window")
    windows = () if window is None else tuple(
        None if (i + 1) % sliding_period == 0 else int(window) for i in range(layers))
    return {"hidden_act": "gelu_tanh", "norm_weight_offset": 1.0, "sandwich_norms": True, "scale_embeddings": True,
            "query_pre_attn_scalar": float(scalar), "layer_windows": windows,
            "attn_logit_softcap": _float_or_none(key("attn_logit_softcapping")),
            "final_logit_softcap": _float_or_none(key("final_logit_softcapping"))}


def _gguf_gemma3(key: GgufKey) -> dict[str, Any]:
    """llama.cpp's Gemma 3 rotates its sliding layers by a base of 10000, whatever the global one."""
    return _gguf_gemma(key, sliding_period=6, layers_of_27b=62) | {"qk_norm": True, "rope_local_theta": 10000.0}


def _phi3(config: dict[str, Any]) -> dict[str, Any]:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError("phi3: partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    return {}


FAMILIES = (
    # llama.cpp writes Mixtral as a `llama` with experts.
    Family("llama", ("LlamaForCausalLM", "MistralForCausalLM"), ("llama", "mistral"), _llama, _gguf_experts,
           gguf_permutes_qk=True),
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), _qwen2, default_rms_norm_eps=1e-6),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), _qwen3, lambda key: {"qk_norm": True},
           default_rms_norm_eps=1e-6),
    Family("mixtral", ("MixtralForCausalLM",), (), _mixtral),
    Family("qwen3-moe", ("Qwen3MoeForCausalLM",), ("qwen3moe",), _qwen3_moe,
           lambda key: {"qk_norm": True} | _gguf_experts(key), default_rms_norm_eps=1e-6),
    Family("phi3", ("Phi3ForCausalLM",), ("phi3",), _phi3),
    Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), _gemma2,
           lambda key: _gguf_gemma(key, sliding_period=2, layers_of_27b=46), default_rms_norm_eps=1e-6),
    Family("gemma3", ("Gemma3ForCausalLM",), ("gemma3",), _gemma3, _gguf_gemma3, default_rms_norm_eps=1e-6),
)


def hf_family(architecture: str) -> Family:
    return _family(architecture, lambda f: f.hf_architectures, "architecture")


def gguf_family(architecture: str) -> Family:
    return _family(architecture, lambda f: f.gguf_architectures, "GGUF architecture")


def _family(architecture: str, names: Callable[[Family], tuple[str, ...]], what: str) -> Family:
    for family in FAMILIES:
        if architecture in names(family):
            return family
    supported = [a for f in FAMILIES for a in names(f)]
    raise ModelLoadError(f"{what} {architecture!r} is not supported; supported architectures: {', '.join(supported)}")
