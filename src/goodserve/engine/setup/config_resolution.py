"""Resolving the caller's EngineConfig, once, into a new frozen one whose values are all concrete.

In three stages, as the facts arrive: the device (device, dtype, kernels, quantization, async
scheduling, the sequence ceiling), then the model (its context window bounds the step budget), then the memory (the KV
pool's size bounds the context). The caller's object is never changed.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from goodserve.config import DTYPES, EngineConfig
from goodserve.engine.setup.kv_groups import KVGroups
from goodserve.errors import InvalidRequestError
from goodserve.model.spec import ModelSpec
from goodserve.ops.kernel_choice import triton_available

_TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES if name != "auto"}


def with_overrides(config: EngineConfig | None, overrides: dict) -> EngineConfig:
    config = config or EngineConfig()
    unknown = [key for key in overrides if not hasattr(config, key)]
    if unknown:
        raise InvalidRequestError(f"unknown engine option {unknown[0]!r}")
    return dataclasses.replace(config, **overrides)


def resolve_for_device(config: EngineConfig) -> EngineConfig:
    config.validate()
    device = _resolve_device(config.device)
    if config.speculative_method == "lookahead" and device.type != "cpu":
        # Its side branch (ops/tree_attention.py) runs in torch between the batch's own rows; the
        # CUDA path's captured graphs and ahead-scheduled steps have no place for it yet.
        raise InvalidRequestError(
            "speculative_method 'lookahead' runs on the CPU only: its window's tree mask is applied on the torch "
            "attention path, which CUDA graphs and async scheduling bypass; on a GPU use 'ngram' or "
            "--speculative-model")
    backend = _resolve_attention_backend(config.attention_backend, device)
    return dataclasses.replace(
        config, device=str(device), attention_backend=backend,
        dtype=config.dtype if config.dtype != "auto" else "bfloat16" if device.type == "cuda" else "float32",
        quantization=config.resolved_quantization(device.type), max_num_seqs=config.resolved_max_num_seqs(),
        speculative_method="draft" if config.speculative_model else config.speculative_method,
        pipeline_micro_batches=device.type != "cuda" if config.pipeline_micro_batches is None
        else config.pipeline_micro_batches,
        # Pipelined steps replay CUDA graphs, which need the Triton kernels.
        async_scheduling=config.async_scheduling and device.type == "cuda" and not config.enforce_eager
        and backend == "triton")


def resolve_for_model(config: EngineConfig, spec: ModelSpec) -> EngineConfig:
    """The context window; without chunked prefill a whole prompt must fit one step's budget (and the
    activation memory reserved for it, which the KV pool is sized around)."""
    check_context_length(config.max_model_len, spec)
    context_len = config.max_model_len or spec.max_position_embeddings
    if spec.layer_windows and config.speculative_method == "lookahead":
        raise InvalidRequestError(
            f"speculative_method 'lookahead' is not supported with {spec.name}'s sliding-window attention: its "
            "guesses attend the whole context; use 'ngram' or --speculative-model")
    if spec.attn_logit_softcap is not None and config.speculative_method == "lookahead":
        raise InvalidRequestError(
            f"speculative_method 'lookahead' is not supported with {spec.name}'s soft-capped attention scores: its "
            "guesses' attention has no soft cap; use 'ngram' or --speculative-model")
    budget = config.max_num_batched_tokens if config.enable_chunked_prefill else \
        max(config.max_num_batched_tokens, context_len)
    return dataclasses.replace(config, max_model_len=context_len, max_num_batched_tokens=budget)


def check_context_length(max_model_len: int | None, spec: ModelSpec) -> None:
    """A context past the model's own window runs positions its rotary embedding was never trained on
    (its rope scaling, where it has one, is already counted in that window): refused, not capped."""
    if max_model_len is not None and max_model_len > spec.max_position_embeddings:
        raise InvalidRequestError(
            f"--max-model-len {max_model_len} is longer than the model's context window "
            f"({spec.max_position_embeddings} tokens): give at most {spec.max_position_embeddings}, or leave it "
            f"out to use the whole window")


def resolve_for_pool(config: EngineConfig, num_blocks: int, groups: KVGroups) -> EngineConfig:
    """The pool's size, and a context no longer than one sequence can hold in it."""
    longest = groups.longest_sequence(num_blocks, config.max_num_batched_tokens, config.block_size,
                                      config.max_model_len)
    return dataclasses.replace(config, num_kv_blocks=num_blocks, max_model_len=longest)


def torch_dtype(config: EngineConfig) -> torch.dtype:
    return _TORCH_DTYPES[config.dtype]


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequestError("device cuda was asked for, but no CUDA GPU is available here")
    return torch.device(name)


def _resolve_attention_backend(name: str, device: torch.device) -> str:
    """auto: Triton on CUDA, torch elsewhere. Triton kernels need a CUDA device; on the CPU they run
    only in Triton's interpreter."""
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise InvalidRequestError(
            f"attention_backend 'triton' needs a CUDA device, and this engine runs on {device}: use 'auto' or "
            "'torch' (on the CPU Triton kernels run only in its interpreter, TRITON_INTERPRET=1, as the tests do)")
    return name
