"""Named model shapes, for `dummy:<preset>` random weights and for the calculators."""

from __future__ import annotations

from dataclasses import replace

from goodserve.model.spec import ModelSpec
from goodserve.ops.rope_scaling import LinearRope, RopeScaling

_LLAMA3_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA32_SCALING = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

def _with_and_without_window(spec: ModelSpec) -> tuple[ModelSpec, ModelSpec]:
    return spec, replace(spec, name=f"{spec.name}-global", layer_windows=())


PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(
            name="llama-3.1-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
            num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
            max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING,
            bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
        ),
        ModelSpec(
            name="llama-3.2-1b", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
            num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
            max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA32_SCALING,
            tie_word_embeddings=True, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
        ),
        ModelSpec(
            name="llama-2-7b", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
            num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
            max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,),
        ),
        ModelSpec(
            name="llama-2-13b", vocab_size=32000, hidden_size=5120, intermediate_size=13824,
            num_layers=40, num_heads=40, num_kv_heads=40, head_dim=128,
            max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,),
        ),
        ModelSpec(
            name="llama-3.1-70b", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
            num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
            max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING,
            bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
        ),
        ModelSpec(
            name="qwen2.5-0.5b", vocab_size=151936, hidden_size=896, intermediate_size=4864,
            num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
            max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
            tie_word_embeddings=True, attention_bias=True, eos_token_ids=(151645, 151643),
        ),
        ModelSpec(
            name="smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
            num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
            max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
            bos_token_id=1, eos_token_ids=(2,),
        ),
        ModelSpec(
            name="qwen3-8b", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
            num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
            rope_theta=1000000.0, rms_norm_eps=1e-6, family="qwen3", qk_norm=True,
            eos_token_ids=(151645, 151643),
        ),
        ModelSpec(
            name="qwen3-30b-a3b", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
            num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, max_position_embeddings=40960,
            rope_theta=1000000.0, rms_norm_eps=1e-6, family="qwen3-moe", qk_norm=True,
            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
            eos_token_ids=(151645, 151643),
        ),
        ModelSpec(
            name="mixtral-8x7b", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
            num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=32768,
            rope_theta=1000000.0, family="mixtral", num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=14336, bos_token_id=1, eos_token_ids=(2,),
        ),
        # Gemma-3-12B (text): local layers (window 1024) and every sixth global, with Gemma 3's parts
        # (model/families.py). The -global variant has every layer global: the KV saving is the point.
        *_with_and_without_window(ModelSpec(
            name="gemma-3-12b", vocab_size=262208, hidden_size=3840, intermediate_size=15360,
            num_layers=48, num_heads=16, num_kv_heads=8, head_dim=256, max_position_embeddings=131072,
            rope_theta=1000000.0, rope_scaling=LinearRope(factor=8.0), rms_norm_eps=1e-6,
            tie_word_embeddings=True, family="gemma3", qk_norm=True, bos_token_id=2, eos_token_ids=(1, 106),
            layer_windows=tuple(None if i % 6 == 5 else 1024 for i in range(48)), hidden_act="gelu_tanh",
            norm_weight_offset=1.0, sandwich_norms=True, scale_embeddings=True, query_pre_attn_scalar=256.0,
            rope_local_theta=10000.0,
        )),
        # Tiny random shapes for fast tests.
        ModelSpec(
            name="tiny", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
            eos_token_ids=(1,),
        ),
        ModelSpec(
            name="tiny-qwen", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
            num_heads=4, num_kv_heads=1, head_dim=16, max_position_embeddings=1024,
            attention_bias=True, tie_word_embeddings=True, eos_token_ids=(1,),
        ),
        ModelSpec(
            name="tiny-llama3", vocab_size=512, hidden_size=64, intermediate_size=128,
            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
            rope_theta=500000.0,
            rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=64),
            eos_token_ids=(1,),
        ),
        ModelSpec(
            name="tiny-moe", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024, family="qwen3-moe",
            qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, eos_token_ids=(1,),
        ),
    ]
}


def get_preset(name: str) -> ModelSpec:
    from goodserve.errors import ModelLoadError

    if name not in PRESETS:
        raise ModelLoadError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name]
