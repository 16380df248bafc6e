"""Every EngineConfig field as a command-line flag, for each command that builds an engine.

`--max-num-seqs 64` sets EngineConfig.max_num_seqs; booleans get --flag / --no-flag. The flags
are derived from the dataclass, so a new config field is on the command line without edits here.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from goodserve.config import (
    ATTENTION_BACKENDS,
    BLOCK_SIZES,
    DTYPES,
    KV_CACHE_DTYPES,
    LM_HEAD_QUANTIZATIONS,
    QUANTIZATIONS,
    SCHEDULER_POLICIES,
    SPEC_POLICIES,
    SPECULATIVE_METHODS,
    EngineConfig,
)

_CHOICES = {
    "dtype": DTYPES,
    "scheduler_policy": SCHEDULER_POLICIES,
    "spec_policy": SPEC_POLICIES,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "quantization": tuple(q for q in QUANTIZATIONS if q),
    "attention_backend": ATTENTION_BACKENDS,
    "block_size": BLOCK_SIZES,
    "speculative_method": tuple(m for m in SPECULATIVE_METHODS if m),
    "lm_head_quantization": LM_HEAD_QUANTIZATIONS,
}

_HELP = {
    "seed": "seed of the random weights (dummy:<preset>) and of sampling for requests that give none",
    "block_size": "tokens per KV cache block (the prefix cache shares whole blocks)",
    "kv_cache_dtype": "KV cache storage: auto (the model's dtype), int8, or fp8 (CUDA): about half the memory a "
                      "token (docs/quantization.md)",
    "enable_prefix_caching": "reuse the KV blocks of prompt prefixes already computed",
    "enable_chunked_prefill": "split long prompts into chunks that share steps with decodes (--max-num-batched-tokens "
                              "a step)",
    "makespan_slack": "--scheduler-policy makespan: admit more requests while the steps so far fall short of this "
                      "many times the tokens left over the steps the longest request has left",
    "makespan_min_admit": "--scheduler-policy makespan: admit in lumps of at least this many tokens",
    "quantization_group_size": "--quantization int4: weights per scale (default: the largest of 128, 64, 32 that "
                               "divides the layer)",
    "quantization_awq": "with --quantization int8 / int4: activation-aware scales, searched on a built-in "
                        "calibration text at load (docs/quantization.md)",
    "quantized_checkpoint": "load int8 / int4 / fp8 weights saved by `goodserve quantize` instead of quantizing at load",
    "attention_backend": "auto: Triton kernels on CUDA, torch elsewhere",
    "executor_backend": "uni: the model runs in the engine's process; mp: in a worker process of its own "
                        "(tensor and pipeline parallelism always use one process per rank)",
    "model": "'smollm2-135m' (embedded), a .gguf file, a Hugging Face model directory, or dummy:<preset>",
    "dtype": "weights and activations; auto is bfloat16 on CUDA, float32 on CPU",
    "device": "auto picks cuda when available",
    "max_model_len": "context length limit (default: the model's)",
    "num_kv_blocks": "KV cache pool size in blocks (default: from memory)",
    "gpu_memory_utilization": "fraction of GPU memory for weights + KV cache",
    "cpu_kv_cache_bytes": "KV cache pool size on CPU, in bytes (a draft model's pool included)",
    "max_num_seqs": "most sequences in one batch (default 256; 1024 under --scheduler-policy slo, which sizes "
                    "its batch from the TPOT target below it)",
    "max_num_batched_tokens": "most tokens in one step (prefill chunks + decodes)",
    "step_trace": "append one line of JSON per step to this file: its shape, whether it replayed a CUDA graph, "
                  "the step-time model's prediction and the measured time, the queue (engine/core/step_trace.py)",
    "max_wait_ms": "dynamic batching: how long a partial batch waits to fill",
    "max_n_per_request": "most samples (n) in one request; more get 400 (each counts against --max-waiting)",
    "scheduler_policy": "continuous (FCFS); static / dynamic batching (to measure what continuous buys); makespan: "
                        "longest requests first, the rest spread over the longest one's steps, for offline batches "
                        "whose lengths are known (ignore_eos); slo: by slack to each request's TTFT / TPOT "
                        "targets, a prefill cap from the fitted step time, 429 for TTFTs the queue makes "
                        "impossible, docs/serving.md (default: continuous)",
    "enforce_eager": "no CUDA graphs",
    "tensor_parallel_size": "split the model over this many GPUs (or CPU processes): must divide the attention "
                            "heads; ranks rendezvous through MASTER_ADDR / MASTER_PORT (torchrun's env://), ranks on "
                            "other hosts run `goodserve worker` (docs/architecture.md)",
    "disable_custom_all_reduce": "tensor parallelism on CUDA: NCCL for every all-reduce, not the one-shot "
                                 "all-reduce on symmetric memory that decode's small ones take otherwise "
                                 "(default: False)",
    "pipeline_parallel_size": "split the model's layers into this many contiguous stages (each of "
                              "--tensor-parallel-size ranks)",
    "context_parallel_size": "split each long prompt's prefill over this many GPUs (or CPU processes), each "
                             "holding the whole model and KV cache; decode runs on all of them as on one "
                             "(docs/architecture/parallelism.md)",
    "pipeline_micro_batches": "pipeline parallelism: keep a step in flight for each stage, each over its share "
                              "of the sequences (default: on the CPU; off on CUDA, where the stages run eagerly "
                              "and a step's host time, not its rows, decides: docs/architecture.md)",
    "async_scheduling": "launch step N+1 before step N's tokens reach the host (CUDA graphs only)",
    "quantization": "weight-only int8 / int4 computed at load; fp8: weights per channel and activations per token "
                    "in float8, FP8 tensor-core matmuls (GPUs of compute capability 8.9+); or gguf: run a GGUF file's "
                    "own Q4_0 / Q4_1 / Q8_0 weights as they are (docs/quantization.md); none: unquantized "
                    "(default: gguf for a GGUF model on the CPU, else none)",
    "quantize_lm_head": "with --quantization (or a checkpoint made with it): lm_head quantized too, as "
                        "--lm-head-quantization says (default: False)",
    "lm_head_quantization": "--quantize-lm-head's method: int8 per channel, or int4 with the layers' group size "
                            "(--quantization int4 only; half int8's bytes) (default: int8)",
    "cpu_int8_activations": "GGUF layers on the CPU quantize activation rows to int8 as llama.cpp does: faster, "
                            "but greedy tokens can then depend on the batch (docs/quantization.md)",
    "tokenizer": "tokenizer path, when it differs from the model's",
    "chat_template": "a Jinja chat template file (or the template itself) in place of the tokenizer's, e.g. for "
                     "a base model (default: the tokenizer's)",
    "speculative_method": "speculative decoding: ngram (prompt lookup: propose what followed the last tokens' "
                          "earlier occurrence in the prompt or output), draft (--speculative-model proposes), or "
                          "lookahead (Jacobi iterations in the same step fill an n-gram pool; CPU only); exact, "
                          "docs/architecture.md (default: off)",
    "speculative_model": "draft model for speculative decoding (implies --speculative-method draft): a model "
                         "sharing the target's vocabulary ('smollm2-135m', a path, dummy:<preset>), or "
                         "self:int4 / self:int8 / self:gguf, the target's own weights quantized so (default: none)",
    "num_speculative_tokens": "most tokens proposed per sequence and step (default: 4)",
    "ngram_min": "ngram proposer: shortest suffix matched (default: 1)",
    "ngram_max": "ngram proposer: longest suffix matched, tried first (default: 4)",
    "lookahead_window": "lookahead: parallel Jacobi guesses per level (W; default: 2, as fast as any measured "
                        "on a 2-core CPU, benchmarks/BENCHMARKS.md)",
    "lookahead_ngram": "lookahead: n-gram length N; the window holds N - 1 levels (default: 3)",
    "spec_max_batch": "no speculation while more sequences run than this (verifying costs more than it saves "
                      "in large batches) (default: 8)",
    "spec_policy": "cost: draft per step where each sequence's measured acceptance pays a verify step's cost "
                   "(a table from measurements, engine/spec_decode/policy.py); always: draft "
                   "--num-speculative-tokens for every sequence that may (default: cost)",
}

# Short names kept beside the derived flag (--max-n-per-request is --max-n too).
_ALIASES = {"max_n_per_request": ("--max-n",)}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(hint) -> type:
    """int | None -> int; the parser converts to the base type and keeps None as the default."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


def add_dataclass_arguments(
    parser: argparse.ArgumentParser, cls: type, title: str,
    helps: dict[str, str], choices: dict[str, tuple] | None = None,
    aliases: dict[str, tuple[str, ...]] | None = None,
) -> None:
    """Add a flag per dataclass field, skipping any flag the command already defines itself."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        flag = _flag(field.name)
        if flag in parser._option_string_actions:
            continue
        kind = _base_type(hints[field.name])
        if dataclasses.is_dataclass(kind):  # nested options (EngineConfig.kernels) are set from Python
            continue
        help_text = helps.get(field.name, field.name.replace("_", " "))
        if "default" not in help_text:
            help_text += f" (default: {field.default})"
        if kind is bool:
            group.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction,
                               default=field.default, help=help_text)
        else:
            group.add_argument(flag, *(aliases or {}).get(field.name, ()), dest=field.name, type=kind,
                               default=field.default, choices=(choices or {}).get(field.name), help=help_text)


def dataclass_from_args(cls: type, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


def dataclass_argv(instance) -> list[str]:
    """The flags that rebuild `instance` through add_dataclass_arguments: one per field off its
    default (a child process started with them parses the same dataclass)."""
    argv = []
    for field in dataclasses.fields(instance):
        value = getattr(instance, field.name)
        if value == field.default or dataclasses.is_dataclass(value):
            continue
        if isinstance(value, bool):
            argv.append(_flag(field.name) if value else "--no-" + _flag(field.name)[2:])
        elif value is not None:
            argv += [_flag(field.name), str(value)]
    return argv


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, EngineConfig, "engine options", _HELP, _CHOICES, _ALIASES)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    config = dataclass_from_args(EngineConfig, args)
    config.validate()
    return config
