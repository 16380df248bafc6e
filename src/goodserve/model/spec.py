"""The shape of a decoder model of any family (model/families.py): everything that sizes weights, KV
cache and FLOPs, and the options that pick the family's parts (q/k norms, a mixture of experts)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from goodserve.errors import ModelLoadError
from goodserve.ops.rope_scaling import LinearRope, LongRope, RopeScaling


@dataclass(frozen=True)
class SamplingDefaults:
    """The sampling a model's makers recommend (its generation_config.json): what the server uses where a
    request sets none (`serve --generation-config auto`, as vLLM's default), in place of OpenAI's."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    @classmethod
    def from_generation_config(cls, generation_config: dict) -> SamplingDefaults:
        """The fields it sets (JSON may write 1 for 1.0); the server checks their values at start."""
        found = {f.name: generation_config[f.name] for f in fields(cls) if generation_config.get(f.name) is not None}
        try:
            return cls(**{name: int(v) if name == "top_k" else float(v) for name, v in found.items()})
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"generation_config.json: a sampling field is not a number ({e})") from None

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | LinearRope | LongRope | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 puts biases on q/k/v
    family: str = "llama"  # model/families.py: which registry entry read it
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before rotary
    # A mixture of experts in place of the MLP (Mixtral, Qwen3-MoE): num_experts > 0 experts of
    # moe_intermediate_size columns each, num_experts_per_tok routed per token, their router
    # weights renormalised over the chosen ones where norm_topk_prob.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    sampling_defaults: SamplingDefaults = SamplingDefaults()
    # Sliding-window attention: layer i's queries see only keys fewer than layer_windows[i] positions
    # back (None: every earlier key). Empty: no layer has a window.
    layer_windows: tuple[int | None, ...] = ()
    # Gemma 2/3's parts. Their RMSNorms scale by (norm_weight_offset + weight), in float32; with
    # sandwich_norms each sublayer's output is normed too (post_attention_layernorm and
    # post_feedforward_layernorm) and the MLP's input by its own pre_feedforward_layernorm;
    # scale_embeddings multiplies the embeddings by sqrt(hidden_size).
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    norm_weight_offset: float = 0.0
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None  # attention scale query_pre_attn_scalar**-0.5 (else head_dim's)
    attn_logit_softcap: float | None = None  # attention scores s -> tanh(s / c) * c before the softmax
    final_logit_softcap: float | None = None  # the same on the logits
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' own rotary base (no scaling)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def smallest_window(self) -> int | None:
        return min((w for w in self.layer_windows if w is not None), default=None)

    @property
    def window_of_every_layer(self) -> int | None:
        """The widest window when every layer has one (what a sequence must keep), else None."""
        if not self.layer_windows or None in self.layer_windows:
            return None
        return max(self.layer_windows)

    def num_params(self) -> int:
        return self._params(experts=self.num_experts)

    def num_active_params(self) -> int:
        """Parameters one token's forward pass touches: of a mixture of experts only the routed ones."""
        return self._params(experts=self.num_experts_per_tok)

    def expert_params(self) -> int:
        """One expert's parameters in one layer (gate, up, down)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def _params(self, experts: int) -> int:
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = self.num_experts * h + experts * self.expert_params() if self.is_moe else 3 * h * i
        per_layer = attn + mlp + (4 if self.sandwich_norms else 2) * h
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + embed + head + h

    def num_matmul_params(self) -> int:
        """Parameters that a token multiplies through (embedding lookup excluded, LM head included; of a
        mixture of experts the routed experts only)."""
        return self.num_active_params() - (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)

    def kv_bytes_per_token(self, bytes_per_element: float) -> float:
        """Every layer's K and V of one token (what a sequence within every window holds a token)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    def kv_bytes_per_sequence(self, tokens: float, bytes_per_element: float) -> float:
        """The K/V a sequence of `tokens` needs: a layer with a sliding window keeps only its last
        window tokens (its decode step reads no more)."""
        windows = self.layer_windows or (None,) * self.num_layers
        kept = sum(tokens if w is None else min(tokens, w) for w in windows)
        return 2 * kept * self.num_kv_heads * self.head_dim * bytes_per_element
