"""Engine configuration: one frozen dataclass, shared by the offline API, the server and the CLI, and
the allowed values of its choice fields, which validate(), the flags (engine_args.py) and the engine read.

What the caller gives may say "auto"; the engine resolves it once (engine/setup/config_resolution.py) into
a new EngineConfig whose every value is concrete (device, dtype, backend, pool size, context
length, async on/off). Neither is ever changed in place."""

from __future__ import annotations

from dataclasses import dataclass, field

from goodserve.errors import InvalidRequestError
from goodserve.model_names import EMBEDDED_MODEL, gguf_model_path

DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULER_POLICIES = ("continuous", "static", "dynamic", "makespan", "slo")
SPEC_POLICIES = ("cost", "always")
DEFAULT_MAX_NUM_SEQS = 256
SLO_MAX_NUM_SEQS = 1024
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
BLOCK_SIZES = (8, 16, 32, 64, 128)
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# Codes computed from float weights (at load or by `goodserve quantize`). int8 / int4: weight-only;
# fp8: weights and (per token, dynamically) activations in float8_e4m3fn, an FP8 tensor-core GEMM
# (GPUs of compute capability 8.9+: Ada, Hopper; the CPU runs it for testing).
WEIGHT_QUANTIZATIONS = ("int8", "int4", "fp8")
LM_HEAD_QUANTIZATIONS = ("int8", "int4")
QUANTIZATIONS = (None, "none", *WEIGHT_QUANTIZATIONS, "gguf")  # None: not asked (resolved_quantization)
# uni: the worker runs in the engine's process; mp: in a process of its own (as each of N
# tensor-parallel workers always does)
EXECUTOR_BACKENDS = ("uni", "mp")
SPECULATIVE_METHODS = (None, "ngram", "draft", "lookahead")  # None: no speculative decoding
# --speculative-model self:<q>: the target's own weights, quantized so, as the draft model
SELF_DRAFT_QUANTIZATIONS = (*WEIGHT_QUANTIZATIONS, "gguf")
SELF_DRAFT_PREFIX = "self:"
# int4, one row (batch-1 decode) on CUDA: "tinygemm" (with bfloat16 activations; Triton otherwise),
# "triton" (the GEMV family's one-row path), "rows" (ops/triton_gemv.py's thread-per-row kernel on
# the checkpoint layout) or "rows_repacked" (the same on a copy repacked once at first use; 0.5 byte
# a weight more on the GPU). benchmarks/gpu_int4.py measures the four.
INT4_ONE_ROW_KERNELS = ("tinygemm", "triton", "rows", "rows_repacked")
# What KernelOptions.decode_attention_tuning_by_batch may set (ops/triton_attention.DECODE_TUNING's keys).
DECODE_TUNING_KEYS = ("BLOCK_N", "SPLIT_KEYS", "DIRECT_KEYS", "num_warps", "num_stages")


@dataclass(frozen=True)
class KernelOptions:
    """Kernel and CUDA-graph choices under the user-facing options. The defaults are the measured
    best (benchmarks/BENCHMARKS.md); the benchmarks set the others to compare against them
    (`LLM(model, kernels=KernelOptions(pdl=False))`). Each engine resolves them once, into its
    model's ops/kernel_choice.KernelChoice: two engines in one process may differ."""

    # Programmatic dependent launch of the Triton kernels (ops/pdl.py), where the GPU has it (sm_90+).
    pdl: bool = True
    # int4 one-row matmuls on CUDA (INT4_ONE_ROW_KERNELS); by shape: (out_features, in_features) -> kernel,
    # ahead of int4_one_row_kernel.
    int4_one_row_kernel: str = "tinygemm"
    int4_one_row_kernel_by_shape: dict[tuple[int, int], str] = field(default_factory=dict)
    # The rows kernels' launch per shape, (out_features, in_features) -> ops/triton_gemv.Int4RowsConfig
    # fields as a dict (what benchmarks/gpu_int4.py measured best); else INT4_ROWS_TUNED / its defaults.
    int4_rows_configs: dict[tuple[int, int], dict] = field(default_factory=dict)
    # SwiGLU in the int4 gate_up projection's one-row kernel: where gate_up_proj's one-row kernel is
    # "rows_repacked", its copy pairs gate row j with up row j and the kernel writes silu(gate) * up,
    # so the activation kernel drops out of a batch-1 decode step (benchmarks/gpu_int4.py measures it).
    int4_fused_silu_and_mul: bool = False
    # The residual add + RMSNorm before a MoE block inside its router's launch on the decode GEMV path
    # (one GPU; quant/triton_moe.triton_norm_router): a layer's norm launch drops out of a decode step
    # (benchmarks/gpu_moe.py measures it: --decode-variants '{"norm_router": {"moe_norm_router": true}}').
    # Off: +0.5% on Qwen3-30B-A3B in one call, none in another (H100, benchmarks/BENCHMARKS.md).
    moe_norm_router: bool = False
    # int4 with bfloat16 activations: tinygemm up to this many rows, the Triton kernels above it. On an
    # H100 (benchmarks/results/gpu_gemv_h100.json, Llama-3.1-8B shapes) tinygemm was faster at 1 and 4
    # rows, the tuned Triton GEMV at 16. At 0 the layers never build tinygemm's copy of the weights.
    int4_tinygemm_max_m: int = 4
    # Dense linears, as (out_features, in_features), kept on cuBLAS where the Triton GEMV has a tuned
    # entry (ops/gemv_linear.py routes those shapes' decode rows to it otherwise).
    cublas_linears: tuple[tuple[int, int], ...] = ()
    # How many times over decode attention's splits fill the GPU (ops/triton_attention.default_num_splits).
    decode_attention_waves: int = 2
    # Decode attention's launch by batch size: max_batch -> ops/triton_attention.DECODE_TUNING overrides
    # (e.g. {1: {"DIRECT_KEYS": 512, "BLOCK_N": 128}}); a launch of B sequences takes the entry with the
    # smallest max_batch >= B, none: DECODE_TUNING. `benchmarks/gpu_kernels.py --decode-latency-sweep`
    # prints the table its winners make. Default: up to 16 sequences, contexts up to 512 keys in one split,
    # 128-key tiles: the sweep's pick at batch 1, 4 and 16 with 4 KV heads (Qwen3-30B-A3B's) on an H100
    # (benchmarks/results/decode_tuning_kv4_e861849_h100.json, gpu_kernels_decode_latency_kv4_e861849_h100.json):
    # 3.9 / 5.3 us at batch 1 and 128 / 256 keys against 4.5 / 6.8 with the earlier one-split-to-256 default,
    # equal at 1024 keys, 1-4% slower at 4096; in the engine, that MoE's batch-1 decode 259.6 tok/s against
    # 252.8 (gpu_moe_e861849_h100.json). With 8 KV heads 128-key tiles were likewise faster up to 256 keys
    # and slower at 1024-4096 (gpu_kernels_decode_latency_h100.json).
    decode_attention_tuning_by_batch: dict[int, dict] = field(default_factory=lambda: {
        16: {"DIRECT_KEYS": 512, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3}})
    # Decode-only steps: RoPE and the KV-cache write inside the decode attention kernel (one launch a
    # layer less; ops/triton_attention.NewTokens); off: the separate _rotary_write_kv_kernel first.
    # 0.1-2.7 us faster a layer than the two launches at every measured shape, bit-identical (same file).
    fuse_rotary_into_decode_attention: bool = True
    # Engine level (engine/worker/model_runner.py): steps with prefill chunks of up to this many tokens replay
    # mixed-step CUDA graphs (0: run eagerly); a batch replays the smallest graph that holds it whose
    # replay time is within this share of the fastest that does (inf: always the smallest); a mixed
    # batch's leading decodes go to the decode attention kernel (False: the prefill kernel takes them).
    mixed_graph_max_tokens: int = 2048
    # Prefill launches of few programs (a prefix hit's question) split each query block's keys over more
    # programs and merge them (ops/triton_attention.prefill_num_splits); with it, small steps with one
    # prefill sequence after their decodes replay mixed graphs captured for exactly that, whose prefill
    # launch is that small (engine/worker/cuda_graphs.py). Off: one program a query block.
    split_prefill_attention: bool = True
    # Eager steps (more tokens than the mixed graphs hold): a prefill chunk of at least this many queries
    # attends through torch's FlashAttention over its sequence's K/V gathered from the pool
    # (ops/flash_prefill.py), not the Triton prefill kernel; 0: never. On an H100 flash, its gather
    # included, was faster from 2,048 queries on, with or without cached context before them; at 1,024
    # without context and below it was slower (benchmarks/results/gpu_flash_prefill_0e71985_h100.json).
    flash_prefill_min_tokens: int = 2048
    graph_time_tolerance: float = 0.03
    decode_kernel_for_mixed_decodes: bool = True
    # Tensor parallelism on CUDA: all-reduces of up to this many bytes take the one-shot all-reduce on
    # symmetric memory (model/custom_all_reduce.py), larger ones NCCL; its buffer is this size. One-shot
    # has every rank read each peer's whole message: at TP=2 the bytes of NCCL's ring, at TP=4 twice
    # them, so it pays where latency, not bytes, decides: decode (8 KB a token for an 8B model, so
    # 512 KiB holds a 64-sequence batch), not prefill chunks (MBs, where NCCL's bandwidth wins).
    custom_all_reduce_max_bytes: int = 512 << 10
    # Those all-reduces fused with the residual add and RMSNorm after them, one kernel without a
    # barrier (ops/all_reduce_norm.py); off: the one-shot all-reduce, then the norm's kernel.
    fuse_all_reduce_into_norm: bool = True

    def validate(self) -> None:
        kernels = [self.int4_one_row_kernel, *self.int4_one_row_kernel_by_shape.values()]
        if any(kernel not in INT4_ONE_ROW_KERNELS for kernel in kernels):
            raise InvalidRequestError(f"int4 one-row kernels must be among {INT4_ONE_ROW_KERNELS}, got {kernels}")
        table = self.decode_attention_tuning_by_batch
        if any(max_batch < 1 or not set(tuning) <= set(DECODE_TUNING_KEYS) for max_batch, tuning in table.items()):
            raise InvalidRequestError(f"decode_attention_tuning_by_batch maps batch sizes >= 1 to settings among "
                                      f"{DECODE_TUNING_KEYS}, got {table}")
        if (self.decode_attention_waves < 1 or self.int4_tinygemm_max_m < 0 or self.mixed_graph_max_tokens < 0
                or self.custom_all_reduce_max_bytes < 0 or self.flash_prefill_min_tokens < 0):
            raise InvalidRequestError("decode_attention_waves must be at least 1, int4_tinygemm_max_m, "
                                      "mixed_graph_max_tokens, custom_all_reduce_max_bytes and "
                                      "flash_prefill_min_tokens at least 0")


@dataclass(frozen=True)
class EngineConfig:
    model: str = EMBEDDED_MODEL
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda when available
    seed: int = 0
    max_model_len: int | None = None  # default: the model's context window
    # KV cache
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides the memory-derived pool size
    gpu_memory_utilization: float = 0.90
    cpu_kv_cache_bytes: int = 1 << 30
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    # Scheduler
    scheduler_policy: str = "continuous"
    # None: DEFAULT_MAX_NUM_SEQS, or SLO_MAX_NUM_SEQS under "slo", which sizes its running batch
    # from the TPOT target (engine/core/slo_policy.py), so its ceiling bounds only the graphs captured and
    # the memory reserved: at 256 the queue waited for a slot while steps ran well under the target
    # (benchmarks/BENCHMARKS.md).
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # A file the engine appends one line of JSON to per step: its shape, the step-time model's
    # prediction and the measured time, the queue (engine/core/step_trace.py). None: no trace.
    step_trace: str | None = None
    max_wait_ms: float = 10.0  # dynamic batching: how long a partial batch waits to fill
    max_n_per_request: int = 128  # a request's samples (n): each is a sequence in the queue
    # The makespan policy (engine/core/makespan.py): admit when the steps so far fell short of
    # makespan_slack x (tokens left) / (steps left on the longest), in lumps of >= makespan_min_admit tokens.
    makespan_slack: float = 1.5
    makespan_min_admit: int = 512
    # Model execution
    # weight-only: int8 (per channel) | int4 (per group) | gguf (keep a GGUF file's Q4_0/Q4_1/Q8_0 codes);
    # fp8 (weights per channel, activations per token, FP8 GEMMs; docs/quantization.md) | none.
    # Unset: gguf for a GGUF model on the CPU, else none (resolved_quantization).
    quantization: str | None = None
    quantization_group_size: int | None = None  # int4; None: the largest of 128/64/32 that divides
    quantization_awq: bool = False  # activation-aware scales from a built-in calibration text
    quantized_checkpoint: str | None = None  # a checkpoint saved by `goodserve quantize`
    quantize_lm_head: bool = False  # with quantization: lm_head too (docs/quantization.md)
    # quantize_lm_head's method: int8 per channel, or int4 with the layers' group size (int4 layers only)
    lm_head_quantization: str = "int8"
    # GGUF layers on the CPU: llama.cpp's arithmetic (each activation row quantized to int8 blocks of
    # 32, integer dot products). Faster (1.04x llama.cpp against 0.7x with float32 rows,
    # benchmarks/BENCHMARKS.md), but off by default: the rounding of a row's activations amplifies
    # last-bit differences between batch shapes, so a request's greedy tokens can depend on its
    # batch, and greedy agreement with the float path drops (docs/quantization.md).
    cpu_int8_activations: bool = False
    attention_backend: str = "auto"  # auto: Triton on CUDA, torch elsewhere
    kernels: KernelOptions = field(default_factory=KernelOptions)  # set from Python, not the command line
    enforce_eager: bool = False  # True: no CUDA graphs
    # Launch step N+1 before step N's tokens reach the host, so the host's bookkeeping overlaps the
    # GPU. Engages only where CUDA graphs replay (so on CUDA), every sequence samples (no unfinished
    # prefill chunk), on the device alone (no penalties, logprobs, stop strings or pending
    # min_tokens); else synchronous.
    async_scheduling: bool = True
    tokenizer: str | None = None  # tokenizer path when it differs from the model's
    # A Jinja chat template, or a file holding one, in place of the tokenizer's (vLLM's --chat-template):
    # a base model's, or a fix to a model's own.
    chat_template: str | None = None
    executor_backend: str = "uni"  # world_size > 1 runs its workers in processes whatever this says
    # Tensor parallelism (model/tensor_parallel.py, engine/worker/executor.py): the model split over this many
    # ranks (GPUs, or CPU processes over gloo), which rendezvous through torch.distributed env://
    # (MASTER_ADDR / MASTER_PORT as torchrun sets them; ranks on other hosts run `goodserve worker`).
    tensor_parallel_size: int = 1
    # Tensor parallelism on CUDA: NCCL for every all-reduce, not the one-shot all-reduce on symmetric
    # memory that small ones (decode's) take otherwise (model/custom_all_reduce.py; vLLM's flag).
    disable_custom_all_reduce: bool = False
    # Pipeline parallelism (model/pipeline_parallel.py): the layers split into this many contiguous
    # stages, each of tensor_parallel_size ranks (world: N x M ranks, stage-major).
    pipeline_parallel_size: int = 1
    # Context parallelism (engine/worker/context_parallel.py): a long prompt's prefill split over this many
    # ranks, each with the whole model and a whole KV cache; decode runs whole on every rank.
    context_parallel_size: int = 1
    # Pipeline micro-batches (engine/frontend/engine.py): a step in flight for each stage, each over its share
    # of the sequences. None: on the CPU, where a stage's time grows with its rows, off on CUDA, where
    # the stages run eagerly (no graphs) and their host time, the same at any batch, bounds a step:
    # twice the steps there cost more than the overlap gives (benchmarks/BENCHMARKS.md).
    pipeline_micro_batches: bool | None = None
    # Speculative decoding (engine/spec_decode/): None (off) | ngram (prompt lookup: propose the
    # tokens that followed the last ngram_max..ngram_min tokens' latest earlier occurrence) | draft
    # (a draft model proposes: speculative_model, which alone implies it) | lookahead (Jacobi
    # iterations over a window of lookahead_window columns x lookahead_ngram - 1 levels, computed in
    # the same step, fill an n-gram pool the drafts come from; engine/spec_decode/lookahead.py).
    speculative_method: str | None = None
    # The draft model: a model name / path / dummy:<preset> sharing the target's vocabulary, or
    # self:int4 / self:int8 / self:fp8 / self:gguf (the target's own weights, quantized so).
    speculative_model: str | None = None
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    lookahead_window: int = 2
    lookahead_ngram: int = 3
    # Policy (engine/spec_decode/policy.py): no proposals while more sequences run than this; under
    # it "cost" drafts per step where the measured acceptance pays a verify step's cost, "always"
    # drafts num_speculative_tokens for every sequence that may.
    spec_max_batch: int = 8
    spec_policy: str = "cost"

    def validate(self) -> None:
        checks = [
            (self.scheduler_policy in SCHEDULER_POLICIES,
             f"scheduler_policy must be one of {SCHEDULER_POLICIES}"),
            (self.spec_policy in SPEC_POLICIES, f"spec_policy must be one of {SPEC_POLICIES}"),
            (self.kv_cache_dtype in KV_CACHE_DTYPES, f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}"),
            (self.quantization in QUANTIZATIONS, f"quantization must be one of {QUANTIZATIONS[1:]}"),
            (self.attention_backend in ATTENTION_BACKENDS, f"attention_backend must be one of {ATTENTION_BACKENDS}"),
            (self.block_size in BLOCK_SIZES, f"block_size must be one of {BLOCK_SIZES}"),
            (0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be at least 1"),
            (self.max_num_seqs is None or self.max_num_seqs >= 1, "max_num_seqs must be at least 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be at least 1"),
            (self.max_n_per_request >= 1, "max_n_per_request must be at least 1"),
            (self.dtype in DTYPES, f"dtype must be one of {DTYPES}"),
            (self.executor_backend in EXECUTOR_BACKENDS, f"executor_backend must be one of {EXECUTOR_BACKENDS}"),
            (self.speculative_method in SPECULATIVE_METHODS,
             f"speculative_method must be one of {SPECULATIVE_METHODS[1:]}"),
            (self.num_speculative_tokens >= 1, "num_speculative_tokens must be at least 1"),
            (self.tensor_parallel_size >= 1, "tensor_parallel_size must be at least 1"),
            (self.speculative_method != "draft" or self.speculative_model,
             "speculative_method 'draft' needs --speculative-model (a model, or self:int4 / self:gguf)"),
            (not self.speculative_model or self.speculative_method in (None, "draft"),
             f"--speculative-model proposes with a draft model; it cannot be combined with speculative_method "
             f"{self.speculative_method!r}"),
            (not (self.speculative_model or "").startswith(SELF_DRAFT_PREFIX)
             or self.speculative_model.removeprefix(SELF_DRAFT_PREFIX) in SELF_DRAFT_QUANTIZATIONS,
             f"--speculative-model self:<quantization> takes one of "
             f"{', '.join(SELF_DRAFT_PREFIX + q for q in SELF_DRAFT_QUANTIZATIONS)}"),
            (self.pipeline_parallel_size >= 1, "pipeline_parallel_size must be at least 1"),
            (self.context_parallel_size >= 1, "context_parallel_size must be at least 1"),
            (self.lm_head_quantization in LM_HEAD_QUANTIZATIONS,
             f"lm_head_quantization must be one of {LM_HEAD_QUANTIZATIONS}"),
            (not (self.quantize_lm_head and self.lm_head_quantization == "int4"
                  and self.quantization in ("int8", "fp8")),
             "an int4 lm_head (--lm-head-quantization int4) takes the layers' group size: it needs "
             "--quantization int4"),
            (1 <= self.ngram_min <= self.ngram_max, "ngram_min and ngram_max must satisfy 1 <= min <= max"),
            (self.lookahead_window >= 1 and self.lookahead_ngram >= 2,
             "lookahead_window must be at least 1 and lookahead_ngram at least 2"),
            (self.speculative_method != "lookahead" or self.pipeline_parallel_size == 1,
             "speculative_method 'lookahead' needs pipeline_parallel_size 1: its window's tokens come back from the "
             "last stage's logits, which only the sampled tokens travel from yet"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)
        self._validate_context_parallel()
        self.kernels.validate()
        if self.quantization == "gguf":
            self._validate_gguf_quantization()
        if self.quantization == "fp8" and (self.quantization_awq or self.quantization_group_size):
            raise InvalidRequestError("quantization 'fp8' scales each output channel of the weights and each token of "
                                      "the activations: it takes neither --quantization-awq nor "
                                      "--quantization-group-size (int4's)")
        splits_the_model = self.tensor_parallel_size * self.pipeline_parallel_size > 1
        if splits_the_model and (self.quantized_checkpoint or self.quantization_awq):
            # A checkpoint's codes are not sliced per rank yet (GGUF codes and int8 / int4 computed at
            # load are); AWQ's scale search reads whole layers' activations.
            raise InvalidRequestError(
                "tensor and pipeline parallelism cannot split a --quantized-checkpoint or run --quantization-awq "
                "yet: use "
                "--quantization int8 | int4 | fp8 (computed at load) or a GGUF model's own codes")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size

    def resolved_max_num_seqs(self) -> int:
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        return SLO_MAX_NUM_SEQS if self.scheduler_policy == "slo" else DEFAULT_MAX_NUM_SEQS

    def resolved_quantization(self, device_type: str) -> str | None:
        """Unset, a GGUF model on the CPU keeps its file's codes ('gguf': the weights exactly as stored,
        ~3x float32's decode speed there, as llama.cpp runs them) unless another quantization option
        is set; on CUDA and for other models it stays unquantized. 'none' (the opt-out) becomes None."""
        if self.quantization == "none":
            return None
        if (self.quantization is None and device_type == "cpu" and gguf_model_path(self.model) is not None
                and not (self.quantized_checkpoint or self.quantization_awq or self.quantization_group_size
                         or self.quantize_lm_head)):
            return "gguf"
        return self.quantization

    def _validate_context_parallel(self) -> None:
        """What a context-parallel engine cannot combine with yet: each rank holds the whole model
        (no tensor or pipeline split), and a step's drafts are verified whole, not split."""
        if self.context_parallel_size == 1:
            return
        conflicts = [flag for flag, value in (
            ("--tensor-parallel-size > 1", self.tensor_parallel_size > 1),
            ("--pipeline-parallel-size > 1", self.pipeline_parallel_size > 1),
            ("speculative decoding (--speculative-method / --speculative-model)",
             self.speculative_method or self.speculative_model)) if value]
        if conflicts:
            raise InvalidRequestError(f"--context-parallel-size {self.context_parallel_size} cannot be combined with "
                                      f"{', '.join(conflicts)} yet")

    def _validate_gguf_quantization(self) -> None:
        """The file's codes are used as they are: no option that computes or loads other codes applies."""
        conflicts = [flag for flag, value in (
            ("--quantized-checkpoint", self.quantized_checkpoint), ("--quantization-awq", self.quantization_awq),
            ("--quantization-group-size", self.quantization_group_size),
            ("--quantize-lm-head", self.quantize_lm_head)) if value]
        if conflicts:
            raise InvalidRequestError(
                f"quantization 'gguf' keeps the GGUF file's own codes (group size 32, lm_head as stored); "
                f"it cannot be combined with {', '.join(conflicts)}")
