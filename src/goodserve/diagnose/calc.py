"""Back-of-envelope serving arithmetic: KV cache size, concurrency a memory budget holds, whether a
model fits a GPU at a tensor-parallel degree, and cost per 1M tokens.

KV bytes = 2 (K and V) x layers x kv_heads x head_dim x bytes per element x tokens x batch.
GQA shrinks kv_heads (Llama-3.1-8B keeps 8 KV heads for 32 query heads: 4x less KV than MHA).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from goodserve.errors import InvalidRequestError
from goodserve.model.spec import ModelSpec

DTYPE_BYTES = {"fp32": 4.0, "float32": 4.0, "fp16": 2.0, "float16": 2.0, "bf16": 2.0, "bfloat16": 2.0,
               "auto": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
# Quantized weights: the matmuls' (embeddings stay bf16), with one bf16 scale per group of 128 weights
# (int4; int8 and fp8 keep one a row, fewer: the count errs high).
QUANTIZED_WEIGHT_DTYPES = ("int8", "int4", "fp8")
QUANT_GROUP_SIZE = 128


def dtype_bytes(dtype: str) -> float:
    if dtype not in DTYPE_BYTES:
        raise InvalidRequestError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def kv_cache_bytes(spec: ModelSpec, tokens: int, batch: int = 1, kv_dtype: str = "fp16") -> float:
    return spec.kv_bytes_per_sequence(tokens, dtype_bytes(kv_dtype)) * batch


def window_saving(spec: ModelSpec, tokens: int, kv_dtype: str = "fp16") -> str:
    """The KV one sequence of `tokens` holds, where sliding-window layers keep their window only,
    against what it would hold with every layer global."""
    held = kv_cache_bytes(spec, tokens, 1, kv_dtype)
    all_global = spec.kv_bytes_per_token(dtype_bytes(kv_dtype)) * tokens
    return f"{held / 1e9:.3f} GB ({held / all_global:.0%} of all-global's {all_global / 1e9:.3f} GB)"


def embedding_bytes(spec: ModelSpec, dtype: str = "bf16") -> float:
    """Bytes of the embedding table: quantized dtypes keep it in bf16."""
    return spec.vocab_size * spec.hidden_size * (2.0 if dtype in QUANTIZED_WEIGHT_DTYPES else dtype_bytes(dtype))


def weight_bytes(spec: ModelSpec, dtype: str = "bf16") -> float:
    """Bytes of weights; quantized dtypes quantize the matmul weights and keep embeddings in bf16."""
    bytes_per = dtype_bytes(dtype)
    if dtype not in QUANTIZED_WEIGHT_DTYPES:
        return spec.num_params() * bytes_per
    matmul = spec.num_params() - spec.vocab_size * spec.hidden_size
    scales = matmul / QUANT_GROUP_SIZE * 2.0
    return embedding_bytes(spec, dtype) + matmul * bytes_per + scales


def decode_weight_bytes(spec: ModelSpec, dtype: str = "bf16", batch: float = 1) -> float:
    """Bytes of weights one decode step of `batch` tokens reads: every weight but an untied embedding
    table, of which a token reads one row (left out: 8 KB of Llama-3.1-8B's 15 GB a token), and the
    lm_head whole (a tied one is the table itself, counted once); of a mixture of experts the shared
    weights and only the experts its tokens are routed to, per layer the expected count of distinct
    experts under uniform routing, E (1 - (1 - k / E)^batch): k at batch 1."""
    read = weight_bytes(spec, dtype) - (0.0 if spec.tie_word_embeddings else embedding_bytes(spec, dtype))
    if not spec.is_moe:
        return read
    e, k = spec.num_experts, spec.num_experts_per_tok
    unread = e * (1 - k / e) ** batch
    bytes_per = dtype_bytes(dtype) + (2.0 / QUANT_GROUP_SIZE if dtype in QUANTIZED_WEIGHT_DTYPES else 0.0)
    return read - spec.num_layers * unread * spec.expert_params() * bytes_per


def max_concurrent_sequences(spec: ModelSpec, kv_budget_bytes: float, seq_len: int,
                             kv_dtype: str = "fp16") -> int:
    """How many sequences of seq_len tokens the KV budget holds at once."""
    per_seq = kv_cache_bytes(spec, seq_len, 1, kv_dtype)
    return max(0, math.floor(kv_budget_bytes / per_seq))


@dataclass
class FitReport:
    tp: int
    pp: int
    gpu_memory_bytes: float
    usable_bytes: float  # per GPU, after --gpu-memory-utilization
    weight_bytes_per_gpu: float
    kv_bytes_per_gpu: float  # for the requested batch x seq_len
    kv_budget_per_gpu: float  # what is left for KV after the weights
    max_sequences: int  # at seq_len, across the TP x PP group

    @property
    def fits(self) -> bool:
        return self.weight_bytes_per_gpu + self.kv_bytes_per_gpu <= self.usable_bytes

    @property
    def weights_fit(self) -> bool:
        return self.weight_bytes_per_gpu < self.usable_bytes


def kv_heads_per_gpu(spec: ModelSpec, tp: int) -> int:
    """Tensor parallelism splits KV heads; with fewer KV heads than GPUs each GPU keeps a copy."""
    return max(1, math.ceil(spec.num_kv_heads / tp))


def fit(spec: ModelSpec, gpu_memory_bytes: float, tp: int = 1, seq_len: int = 4096, batch: int = 1,
        dtype: str = "bf16", kv_dtype: str = "bf16", gpu_memory_utilization: float = 0.9,
        activation_reserve_bytes: float = 1e9, pp: int = 1) -> FitReport:
    """Weights + KV per GPU against its usable memory (activations keep a fixed reserve). Pipeline
    stages hold 1 / pp of the weights each (the embedding and lm_head counted as spread evenly) and
    the KV of their layers (the first stages take the extra layer when pp does not divide them)."""
    if tp < 1 or spec.num_heads % tp:
        raise InvalidRequestError(f"tensor-parallel degree {tp} must divide {spec.num_heads} heads")
    usable = gpu_memory_bytes * gpu_memory_utilization - activation_reserve_bytes
    weights = weight_bytes(spec, dtype) / (tp * pp)
    kv_per_token_per_gpu = (2 * math.ceil(spec.num_layers / pp) * kv_heads_per_gpu(spec, tp) * spec.head_dim
                            * dtype_bytes(kv_dtype))
    kv_budget = max(0.0, usable - weights)
    return FitReport(
        tp=tp, pp=pp, gpu_memory_bytes=gpu_memory_bytes, usable_bytes=usable, weight_bytes_per_gpu=weights,
        kv_bytes_per_gpu=kv_per_token_per_gpu * seq_len * batch, kv_budget_per_gpu=kv_budget,
        max_sequences=math.floor(kv_budget / (kv_per_token_per_gpu * seq_len)),
    )


def cost_per_million_tokens(hourly_cost: float, tokens_per_s: float, num_gpus: int = 1) -> float:
    """$ per 1M tokens when the GPUs sustain tokens_per_s all hour."""
    if tokens_per_s <= 0:
        raise InvalidRequestError("throughput must be positive to price tokens")
    return hourly_cost * num_gpus / (tokens_per_s * 3600.0) * 1e6
