"""The engine: add requests, call step() until done. Scheduler decides, runner executes, sampler samples.

One step: schedule -> prepare inputs -> forward -> sample -> append tokens, check stops, detokenize.
Every stage is timed, so the cost of Python around the GPU is visible (EngineStats).

Async scheduling: while steps replay CUDA graphs, every sequence in them samples a token, and all
sample on the device alone, step N+1 is launched before step N's tokens reach the host (its decode
input tokens are copied on the device; it may also admit waiting requests, whose prompt tokens the
host has), and step N's tokens are appended and checked while the GPU runs N+1. A sequence that
stopped at N wastes its slot in N+1; preemption and unfinished prefill chunks flush first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from goodserve.config import EngineConfig
from goodserve.engine.block_pool import BlockPool
from goodserve.engine.grammar import GrammarCompiler, accept_ahead, accept_token
from goodserve.engine.isolation import find_culprits, rewind_generators, sub_batch
from goodserve.engine.kv_cache import kv_storage_dtype, num_blocks_for_memory
from goodserve.engine.model_runner import ModelInput, ModelOutput, ModelRunner
from goodserve.engine.request import Request
from goodserve.engine.sampling_inputs import build_sampling_batch
from goodserve.engine.scheduler import ScheduledBatch, Scheduler
from goodserve.engine.sequence import Sequence
from goodserve.errors import InvalidRequestError, PromptTooLongError
from goodserve.model.detokenizer import IncrementalDetokenizer
from goodserve.model.loader import load_model, load_tokenizer
from goodserve.ops.cpu_linear import pack_linears_for_cpu
from goodserve.ops.kernel_choice import KernelChoice, choose_kernels, use_kernels
from goodserve.ops.sampler import SamplerOutput, gather_logprobs, sample
from goodserve.outputs import Logprob, LogprobsEntry, RequestOutput
from goodserve.sampling_params import SamplingParams

logger = logging.getLogger("goodserve.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_used_kv_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    num_pipelined_steps: int  # steps launched before the previous step's tokens reached the host
    last_batch_tokens: int
    last_batch_seqs: int
    schedule_seconds_total: float
    prepare_seconds_total: float
    forward_seconds_total: float
    sample_seconds_total: float
    detokenize_seconds_total: float
    output_seconds_total: float  # building RequestOutputs for callers


@dataclass
class _StepTimes:
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    detokenize: float = 0.0
    output: float = 0.0


@dataclass
class _StepResult:
    """A computed step, not yet recorded: what `Engine._commit` needs."""

    sample_seqs: list[Sequence]
    token_ids: list[int]
    sampled: SamplerOutput | None
    prompt_logprobs: list[tuple]  # Engine._prompt_logprobs
    pooled: list[tuple[Sequence, int, torch.Tensor]]  # (seq, first position pooled, hidden-state sum)


@dataclass
class _InFlight:
    """A launched step whose sampled tokens have not been read on the host yet."""

    batch: ScheduledBatch
    sample_rows: list[int]  # the batch rows that sampled, in the order of `tokens`
    tokens: torch.Tensor  # [len(sample_rows)] int64 on the device: the next step's inputs
    host_tokens: torch.Tensor  # the same on the host (pinned on CUDA), filled by an async copy
    copied: torch.cuda.Event | None  # recorded after that copy; None on the CPU (copies are synchronous)


def apply_quantization(loaded, config: EngineConfig) -> None:
    """Weight-only quantization in place: from a saved checkpoint, or computed at load time.
    (quantization 'gguf' happens in the loader: the file's own codes.)"""
    if config.quantization == "gguf":
        return
    if config.quantized_checkpoint:
        from goodserve.quant.checkpoint import load_quantized_into

        load_quantized_into(loaded.model, config.quantized_checkpoint, loaded.revision, config.quantize_lm_head)
    elif config.quantization:
        from goodserve.quant.apply import quantize_model
        from goodserve.quant.awq import default_calibration_text

        calibration = None
        if config.quantization_awq:
            if loaded.tokenizer is None:
                raise InvalidRequestError("quantization_awq needs a tokenizer for its calibration text")
            calibration = loaded.tokenizer.encode(default_calibration_text())
        quantize_model(loaded.model, config.quantization, config.quantization_group_size, calibration,
                       lm_head=config.quantize_lm_head)


def specialize_linears(model, device: torch.device, config: EngineConfig, kernels: KernelChoice) -> None:
    """Once the weights are final, the fastest kernel per linear: oneDNN packed weights for float32
    on the CPU, and for int4 layers one native call per decode step; on CUDA, the Triton GEMV for
    one-row matmuls where it was measured to beat cuBLAS."""
    if device.type == "cpu":
        from goodserve.native import decoder_layer

        if config.cpu_int8_activations:
            from goodserve.quant.gguf_native import use_int8_activations

            use_int8_activations(model)
        pack_linears_for_cpu(model)
        decoder_layer.attach(model)
    elif kernels.triton:
        from goodserve.ops.gemv_linear import route_decode_rows_to_gemv

        route_decode_rows_to_gemv(model, kernels)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequestError("device cuda was asked for, but no CUDA GPU is available here")
    return torch.device(name)


def check_attention_backend(name: str, device: torch.device) -> None:
    """Triton kernels need a CUDA device; on the CPU they run only in Triton's interpreter."""
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise InvalidRequestError(
            f"attention_backend 'triton' needs a CUDA device, and this engine runs on {device}: use 'auto' or "
            "'torch' (on the CPU Triton kernels run only in its interpreter, TRITON_INTERPRET=1, as the tests do)")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        config = config or EngineConfig()
        unknown = [key for key in overrides if not hasattr(config, key)]
        if unknown:
            raise InvalidRequestError(f"unknown engine option {unknown[0]!r}")
        config = dataclasses.replace(config, **overrides)  # the engine's own copy: it settles some values
        config.validate()
        self.device = resolve_device(config.device)
        check_attention_backend(config.attention_backend, self.device)
        config.resolve_quantization(self.device.type)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        kernels = choose_kernels(config.attention_backend, config.kernels, self.device)
        loaded = load_model(config.model, self.dtype, self.device, seed=config.seed,
                            keep_gguf_quantization=config.quantization == "gguf")
        apply_quantization(loaded, config)
        specialize_linears(loaded.model, self.device, config, kernels)
        use_kernels(loaded.model, kernels)
        self.spec, self.model, self.tokenizer = loaded.spec, loaded.model, loaded.tokenizer
        if config.tokenizer:
            self.tokenizer = load_tokenizer(config.tokenizer, self.spec)
        self.eos_token_ids = sorted(set(self.spec.eos_token_ids) | set(
            self.tokenizer.eos_token_ids if self.tokenizer else []))
        context_len = min(config.max_model_len or self.spec.max_position_embeddings, self.spec.max_position_embeddings)
        if not config.enable_chunked_prefill:  # a whole prompt must fit one step's budget (and activations)
            config.max_num_batched_tokens = max(config.max_num_batched_tokens, context_len)
        self.config = config
        kv_dtype = kv_storage_dtype(config, self.dtype)
        num_blocks = num_blocks_for_memory(self.spec, config, self.device, self.dtype, kv_dtype)
        self.max_model_len = min(context_len, num_blocks * config.block_size)
        self.runner = ModelRunner(config, self.model, num_blocks, kv_dtype, self.max_model_len, self.device)
        # quantize_lm_head is not in it: lm_head computes logits from the hidden states, never K/V.
        salt = (f"{loaded.revision}|{config.kv_cache_dtype}|{config.quantization}|"
                f"{config.quantized_checkpoint}|{config.quantization_awq}").encode()
        self.pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching, salt)
        self.scheduler = Scheduler(config, self.pool)
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.num_pipelined_steps = 0
        self.last_batch = (0, 0)
        self.times = _StepTimes()
        # Async scheduling: at most one step in flight beyond the one being finished, so launches use
        # two host buffers (row 0: sampled tokens out, row 1: row indices in) and events in turn.
        self._inflight: _InFlight | None = None
        cuda = self.device.type == "cuda"
        self._host_buffers = [torch.zeros(2, config.max_num_seqs, dtype=torch.int64, pin_memory=cuda)
                              for _ in range(2)]
        self._copy_events = [torch.cuda.Event() for _ in range(2)] if cuda else [None, None]
        self._turn = 0
        self._grammars: GrammarCompiler | None = None  # built on the first request with a grammar
        self._grammars_lock = threading.Lock()  # the server validates (compiles) on its tokenizer pool
        logger.info(
            "model %s (%s) dtype=%s device=%s kv_cache=%d blocks x %d tokens (%s) max_model_len=%d",
            config.model, loaded.source, str(self.dtype).removeprefix("torch."), self.device,
            num_blocks, config.block_size, str(kv_dtype).removeprefix("torch."), self.max_model_len,
        )

    # ---- requests ------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass prompt token ids instead")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    @property
    def grammars(self) -> GrammarCompiler:
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise InvalidRequestError("structured outputs need a tokenizer, and this model has none")
                self._grammars = GrammarCompiler(self.tokenizer, self.spec.vocab_size)
        return self._grammars

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Raise a typed error for a request that can never run; return its maximum length."""
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)  # an invalid grammar is the caller's error
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        if any(not 0 <= t < self.spec.vocab_size for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.spec.vocab_size})")
        if any(t >= self.spec.vocab_size for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be in [0, {self.spec.vocab_size})")
        if any(t >= self.spec.vocab_size for t in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {self.spec.vocab_size})")
        if params.n > self.config.max_n_per_request:
            raise InvalidRequestError(f"n must be at most {self.config.max_n_per_request}, got {params.n}")
        prompt_len = len(prompt_token_ids)
        if prompt_len >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {prompt_len} tokens, but this model's context is {self.max_model_len} "
                "tokens (room for at least one new token is needed): shorten the prompt"
            )
        if params.max_tokens is None:
            return self.max_model_len
        if prompt_len + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{prompt_len + params.max_tokens} were requested ({prompt_len} in the prompt, "
                f"{params.max_tokens} max_tokens): lower max_tokens or shorten the prompt"
            )
        return prompt_len + params.max_tokens

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt_text, prompt_ids = self.tokenize_prompt(prompt)
        max_len = self.validate_request(prompt_ids, params)
        arrival_time = arrival_time or time.time()
        seqs = [self._new_sequence(request_id, i, prompt_ids, params, max_len, arrival_time)
                for i in range(params.n)]
        request = Request(request_id, prompt_text, prompt_ids, seqs,
                          holdback=max((len(s) for s in params.stop), default=1) - 1)
        request.detokenizers = [
            IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
            if self.tokenizer else None
            for _ in seqs
        ]
        self.requests[request_id] = request
        # n > 1 with prefix caching: the other samples wait until the first has cached the prompt.
        sharing = len(seqs) > 1 and self.config.enable_prefix_caching
        request.pending = seqs[1:] if sharing else []
        for seq in seqs[:1] if sharing else seqs:
            self.scheduler.add(seq)

    def _new_sequence(self, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams,
                      max_len: int, arrival_time: float) -> Sequence:
        generator = None
        if params.seed is not None:
            # manual_seed takes 64 bits; negative seeds wrap as it wraps them itself
            generator = torch.Generator(device=self.device).manual_seed((params.seed + index) % 2**64)
        seq = Sequence(
            seq_id=f"{request_id}#{index}", request_id=request_id, index=index,
            token_ids=list(prompt_ids), num_prompt_tokens=len(prompt_ids), params=params,
            max_len=max_len, arrival_time=arrival_time, generator=generator,
        )
        if seq.wants_prompt_logprobs:
            seq.prompt_logprobs.append(None)  # the first token has no context to be predicted from
        if params.structured_outputs is not None:  # compiled by validate_request: a cache hit
            seq.grammar = self.grammars.new_state(self.grammars.compile(params.structured_outputs))
        return seq

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq, detokenizer in zip(request.seqs, request.detokenizers):
            if not seq.is_finished:
                if detokenizer is not None:
                    _detokenize_pending(seq, detokenizer)
                self.scheduler.finish(seq, "abort")
                seq.metrics.finished_time = time.time()
        return request.output()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # ---- one step ------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one step; return the outputs of the requests it advanced (cumulative), or with
        finished_only only of those it finished: building a long request's output every step costs
        time proportional to its length, which offline callers need not pay."""
        changed = None
        if self._inflight is None:
            t0 = time.perf_counter()
            batch = self.scheduler.schedule()
            t1 = time.perf_counter()
            self.times.schedule += t1 - t0
            if not batch:
                return []
            self._count_step(batch)
            try:
                result = self._start(batch, t1)
            except Exception as exc:  # a failed step fails the requests that cause it, never the engine
                changed = self._isolate(batch, exc, stream_text=not finished_only)
            else:
                if result is None:  # launched ahead of its tokens: finished below, or by the next call
                    self.scheduler.advance(batch)
                else:
                    changed = self._commit(batch, result, stream_text=not finished_only)
        if changed is None:
            changed = self._step_pipelined(stream_text=not finished_only)
        t_collect = time.perf_counter()
        outputs = self._collect(changed, finished_only)
        self.times.output += time.perf_counter() - t_collect
        return outputs

    def _count_step(self, batch: ScheduledBatch) -> None:
        self.num_steps += 1
        self.last_batch = (batch.num_tokens, len(batch.seqs))

    def _start(self, batch: ScheduledBatch, t_start: float) -> _StepResult | None:
        """Compute the batch, or launch it as the in-flight step (then None) where it may pipeline."""
        inputs = self.runner.prepare(batch)
        if self._can_pipeline(batch, inputs):
            self._inflight = self._launch(batch, inputs, t_start)
            return None
        return self._compute(batch, inputs, t_start)

    def _compute(self, batch: ScheduledBatch, inputs: ModelInput, t_start: float, trial: bool = False) -> _StepResult:
        """Forward and sampling: everything a request's bad input can break, with nothing the engine
        keeps changed yet (a trial run also gives back the generators' noise)."""
        t1 = time.perf_counter()
        output = self.runner.execute(inputs)
        sample_seqs = [batch.seqs[row] for row in inputs.sample_rows]
        # Built while the GPU runs the forward: it needs only the requests' settings.
        sampling = build_sampling_batch(sample_seqs, self.spec.vocab_size, self.device, self.eos_token_ids) \
            if sample_seqs else None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()
        sampled = None
        if sampling is not None:
            with rewind_generators(sampling, always=trial):
                sampled = sample(output.logits, sampling, self.model.kernels, output.logits_argmax)
        pooled = [(batch.seqs[row], batch.seqs[row].num_computed_tokens, total) for row, total in output.pooled.items()]
        result = _StepResult(sample_seqs, sampled.token_ids.tolist() if sampled else [], sampled,
                             self._prompt_logprobs(batch, output), pooled)
        t3 = time.perf_counter()
        self.times.prepare += t1 - t_start
        self.times.forward += t2 - t1
        self.times.sample += t3 - t2
        return result

    def _commit(self, batch: ScheduledBatch, result: _StepResult, stream_text: bool) -> set[str]:
        """Advance the batch and record its outputs; an error in one sequence's bookkeeping fails its
        request alone."""
        t0 = time.perf_counter()
        self.scheduler.advance(batch)
        self._release_siblings(batch)
        for seq, first, values, ids, ranks in result.prompt_logprobs:
            self._guarded(seq, self._store_prompt_logprobs, seq, first, values, ids, ranks)
        for seq, first, total in result.pooled:  # a recomputed prompt (after a preemption) starts over
            seq.pooled = total if first == 0 or seq.pooled is None else seq.pooled + total
        for seq in batch.seqs:
            if seq.params.prefill_only and not seq.is_finished and seq.num_computed_tokens >= seq.num_prompt_tokens:
                self._guarded(seq, self._finish_prefill_only, seq)
        for i, (seq, token) in enumerate(zip(result.sample_seqs, result.token_ids)):
            if not seq.is_finished:  # else a sibling's failure aborted it just now
                self._guarded(seq, self._append_sampled, seq, token, result.sampled, i, stream_text)
        self.times.detokenize += time.perf_counter() - t0
        return {seq.request_id for seq in batch.seqs}

    def _isolate(self, batch: ScheduledBatch, error: Exception, stream_text: bool) -> set[str]:
        """The step raised before anything advanced: fail the requests whose sequences fail alone,
        with their own errors, then run the rest as this step."""
        logger.warning("step of %d sequences failed (%s: %s); isolating its culprit", len(batch.seqs),
                       type(error).__name__, error)
        for seq, exc in find_culprits(batch, error, self._trial):
            logger.error("request %s failed its step: %s: %s", seq.request_id, type(exc).__name__, exc,
                         exc_info=exc)
            self._fail_request(seq.request_id, exc)
        rest = sub_batch(batch, [row for row, seq in enumerate(batch.seqs) if not seq.is_finished])
        changed = {seq.request_id for seq in batch.seqs}
        if rest:
            t0 = time.perf_counter()
            try:
                result = self._compute(rest, self.runner.prepare(rest), t0)
            except Exception as exc:  # the failure needs the whole batch (none failed alone): fail it
                logger.exception("step failed again without its culprits; aborting its %d sequences",
                                 len(rest.seqs))
                return changed | self._fail(rest, exc)
            changed |= self._commit(rest, result, stream_text)
        return changed

    def _trial(self, batch: ScheduledBatch) -> None:
        self._compute(batch, self.runner.prepare(batch), time.perf_counter(), trial=True)

    def _guarded(self, seq: Sequence, record, *args) -> None:
        """One sequence's bookkeeping; an error there fails its request, not the step."""
        try:
            record(*args)
        except Exception as exc:
            logger.exception("recording the output of request %s failed", seq.request_id)
            self._fail_request(seq.request_id, exc)

    # ---- async scheduling ----------------------------------------------------------------
    def _can_pipeline(self, batch: ScheduledBatch, inputs: ModelInput) -> bool:
        """A step may run ahead of its tokens' arrival on the host if it replays a graph and every
        sequence samples, on the device alone (then so do the steps after it)."""
        return (self.config.async_scheduling and inputs.graph is not None
                and len(inputs.sample_rows) == len(batch.seqs) and all(_samples_on_device(seq) for seq in batch.seqs))

    def _step_pipelined(self, stream_text: bool) -> set[str]:
        """Launch the next step (if the scheduler allows one without the in-flight step's
        tokens), then finish the in-flight step on the host while the GPU runs the next."""
        current, self._inflight = self._inflight, None
        try:
            self._launch_ahead(current)
            changed = self._complete(current, stream_text)
            if self._inflight is not None:  # its input tokens are on the host now: register full blocks
                self.scheduler.advance(self._inflight.batch)
            return changed
        except Exception as exc:
            batches = [current.batch] + ([self._inflight.batch] if self._inflight is not None else [])
            self._inflight = None
            logger.exception("async step failed; aborting its %d sequences", len(current.batch.seqs))
            if self.device.type == "cuda":  # nothing queued may still read the host buffers
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize(self.device)
            return set().union(*(self._fail(batch, exc) for batch in batches))

    def _launch_ahead(self, current: _InFlight) -> None:
        """Launch the step after `current`, if the scheduler allows one without current's tokens. If
        its launch raises, it is dropped: nothing advanced, its blocks are the ones the next step
        allocates anyway, and the next step, synchronous, runs its sequences again and isolates
        the request that broke it."""
        t0 = time.perf_counter()
        # Sequences whose in-flight token is certainly their last (by length) go no further;
        # those that will stop on the token itself are found only later: their next token is spare.
        rows = [row for row, seq in enumerate(current.batch.seqs) if not seq.is_finished and not _ends_by_length(seq)]
        if len(current.sample_rows) < len(current.batch.seqs):  # an unfinished prefill chunk
            rows = []
        ahead = self.scheduler.schedule_ahead([current.batch.seqs[row] for row in rows], _samples_on_device)
        t1 = time.perf_counter()
        self.times.schedule += t1 - t0
        if not ahead:
            return
        self._count_step(ahead)
        self.num_pipelined_steps += 1
        try:
            self._inflight = self._launch(ahead, self.runner.prepare(ahead), t1, (current, rows))
        except Exception as exc:
            logger.warning("launching a step ahead failed (%s: %s); its sequences run synchronously next",
                           type(exc).__name__, exc)

    def _launch(self, batch: ScheduledBatch, inputs: ModelInput, t_start: float,
                previous: tuple[_InFlight, list[int]] | None = None) -> _InFlight:
        """Enqueue a step and its sampling; start copying its tokens to the host. previous: the
        in-flight step whose tokens (at the given rows, every one of its rows sampled) are the inputs
        of this step's first batch.num_ahead sequences."""
        self._turn ^= 1
        host = self._host_buffers[self._turn]
        if previous is not None:
            step, rows = previous
            tokens = step.tokens[: len(rows)]
            if rows != list(range(len(rows))):
                index = host[1, : len(rows)]
                index.numpy()[:] = rows
                tokens = step.tokens.index_select(0, index.to(self.device, non_blocking=True))
            # Decodes lead the batch, a token each; after the inputs' own copy: same stream.
            inputs.input_ids[: len(rows)].copy_(tokens)
        t1 = time.perf_counter()
        output = self.runner.execute(inputs)
        sample_seqs = [batch.seqs[row] for row in inputs.sample_rows]
        if previous is not None and any(seq.grammar is not None for seq in sample_seqs):
            _accept_tokens_ahead(previous[0])  # the masks need them; the forward runs meanwhile
        sampling = build_sampling_batch(sample_seqs, self.spec.vocab_size, self.device, self.eos_token_ids)
        t2 = time.perf_counter()
        # A copy of its own: the next replay of the same graph overwrites the graph's argmax buffer.
        with rewind_generators(sampling):
            tokens = sample(output.logits, sampling, self.model.kernels, output.logits_argmax).token_ids.clone()
        host_tokens = host[0, : len(sample_seqs)]
        host_tokens.copy_(tokens, non_blocking=True)
        copied = self._copy_events[self._turn]
        if copied is not None:
            copied.record()
        self.times.prepare += t1 - t_start
        self.times.forward += t2 - t1
        self.times.sample += time.perf_counter() - t2
        return _InFlight(batch, inputs.sample_rows, tokens, host_tokens, copied)

    def _complete(self, step: _InFlight, stream_text: bool) -> set[str]:
        """Wait for the step's tokens on the host, then append them and check the stop conditions."""
        t0 = time.perf_counter()
        if step.copied is not None:
            step.copied.synchronize()
        token_ids = step.host_tokens.tolist()
        t1 = time.perf_counter()
        self._release_siblings(step.batch)
        for row, token in zip(step.sample_rows, token_ids):
            seq = step.batch.seqs[row]
            if not seq.is_finished:  # else it stopped at the step before (this token is spare) or was aborted
                self._guarded(seq, self._append_token, seq, token, None, stream_text)
        self.times.forward += t1 - t0  # the host waits for the GPU here
        self.times.detokenize += time.perf_counter() - t1
        return {seq.request_id for seq in step.batch.seqs}

    def _release_siblings(self, batch: ScheduledBatch) -> None:
        for seq in batch.seqs:
            request = self.requests.get(seq.request_id)
            if request is not None and request.pending and seq.num_computed_tokens >= seq.num_prompt_tokens:
                for sibling in request.pending:
                    self.scheduler.add(sibling)
                request.pending = []

    def _fail(self, batch: ScheduledBatch, exc: Exception) -> set[str]:
        for seq in batch.seqs:
            self._fail_request(seq.request_id, exc)
        return {seq.request_id for seq in batch.seqs}

    def _fail_request(self, request_id: str, exc: Exception) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        request.error = request.error or f"{type(exc).__name__}: {exc}"
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                seq.metrics.finished_time = time.time()

    def _collect(self, changed: set[str], finished_only: bool) -> list[RequestOutput]:
        outputs = []
        for request_id in changed:
            request = self.requests.get(request_id)
            if request is None or (finished_only and not request.finished):
                continue
            outputs.append(request.output())
            if request.finished:
                del self.requests[request_id]
        return outputs

    # ---- after sampling ------------------------------------------------------------------
    @staticmethod
    def _prompt_logprobs(batch: ScheduledBatch, output: ModelOutput) -> list[tuple]:
        """(seq, index of the first prompt token predicted, values, ids, ranks) for each row with prompt
        logits. Logits at position p predict token p + 1; a chunk starts at the first uncomputed
        position (0 again after a preemption, which recomputes the prompt)."""
        found = []
        for row, logits in output.prompt_logits.items():
            seq = batch.seqs[row]
            first = seq.num_computed_tokens + 1
            targets = torch.tensor(seq.token_ids[first : first + logits.shape[0]], device=logits.device)
            values, ids, ranks = gather_logprobs(logits, targets, seq.params.prompt_logprobs)
            found.append((seq, first, values.tolist(), ids.tolist(), ranks.tolist()))
        return found

    def _store_prompt_logprobs(self, seq: Sequence, first: int, values: list, ids: list, ranks: list) -> None:
        """Entries from token `first` on; a recomputed prompt (after a preemption) replaces its own."""
        del seq.prompt_logprobs[first:]
        seq.prompt_logprobs.extend(_entry(v, i, r, self.tokenizer) for v, i, r in zip(values, ids, ranks))

    def _append_sampled(self, seq: Sequence, token: int, sampled: SamplerOutput, row: int, stream_text: bool) -> None:
        self._append_token(seq, token, _logprobs_entry(sampled, row, seq.params.logprobs, self.tokenizer), stream_text)

    def _append_token(self, seq: Sequence, token: int, logprobs: LogprobsEntry | None, stream_text: bool) -> None:
        """Record a sampled token and check the stop conditions.

        Text is detokenized as tokens arrive only where it is read before the end: when streaming
        (stream_text) or to find stop strings. Otherwise it is detokenized once, at the finish,
        which costs one tokenizer call per request instead of two per token.
        """
        now = time.time()
        seq.token_ids.append(token)
        metrics = seq.metrics
        metrics.token_times.append(now)
        metrics.first_token_time = metrics.first_token_time or now
        metrics.last_token_time = now
        if logprobs is not None and seq.params.logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token].logprob
        params = seq.params
        may_stop = seq.num_output_tokens >= params.min_tokens
        request = self.requests[seq.request_id]
        detokenizer = request.detokenizers[seq.index]
        # A grammar ends where it accepts its stop token (it allows one only once its text is complete).
        grammar_done = seq.grammar is not None and accept_token(seq, token)
        if grammar_done or may_stop and (
                token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos)):
            # the stop token itself is not part of the text
            self._finish(seq, "stop", token if token in params.stop_token_ids else None, detokenizer,
                         text_tokens=seq.num_tokens - 1)
            return
        if detokenizer is not None and (stream_text or params.stop):
            delta = _detokenize_pending(seq, detokenizer)
            if may_stop and params.stop and self._truncate_at_stop_string(seq, len(delta)):
                return
        if seq.num_output_tokens >= (params.max_tokens or seq.max_len) or seq.num_tokens >= seq.max_len:
            self._finish(seq, "length", None, detokenizer)

    def _finish_prefill_only(self, seq: Sequence) -> None:
        if seq.params.pooling is not None:  # the mean's direction is the sum's: normalizing drops the count
            seq.embedding = torch.nn.functional.normalize(seq.pooled, dim=0).tolist()
        self._finish(seq, "length", None, self.requests[seq.request_id].detokenizers[seq.index])

    def _truncate_at_stop_string(self, seq: Sequence, new_chars: int) -> bool:
        for stop in seq.params.stop:  # only where the new text could complete a stop string
            at = seq.text.find(stop, max(0, len(seq.text) - new_chars - len(stop) + 1))
            if at >= 0:
                seq.text = seq.text[: at + (len(stop) if seq.params.include_stop_str_in_output else 0)]
                self._finish(seq, "stop", stop, None)
                return True
        return False

    def _finish(self, seq: Sequence, reason: str, stop_reason, detokenizer,
                text_tokens: int | None = None) -> None:
        if detokenizer is not None:
            _detokenize_pending(seq, detokenizer, text_tokens)
            seq.text += detokenizer.flush()
        self.scheduler.finish(seq, reason, stop_reason)
        seq.metrics.finished_time = time.time()

    # ---- introspection -------------------------------------------------------------------
    def stats(self) -> EngineStats:
        pool = self.pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks=pool.num_blocks,
            num_used_kv_blocks=pool.num_used_blocks,
            kv_cache_usage=pool.num_used_blocks / pool.num_blocks,
            prefix_cache_queries=pool.counters.queries,
            prefix_cache_hits=pool.counters.hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_pipelined_steps=self.num_pipelined_steps,
            last_batch_tokens=self.last_batch[0],
            last_batch_seqs=self.last_batch[1],
            schedule_seconds_total=self.times.schedule,
            prepare_seconds_total=self.times.prepare,
            forward_seconds_total=self.times.forward,
            sample_seconds_total=self.times.sample,
            detokenize_seconds_total=self.times.detokenize,
            output_seconds_total=self.times.output,
        )


def _samples_on_device(seq: Sequence) -> bool:
    """Whether seq's next tokens need no host data from the step before: no penalties (they count
    output tokens), no min_tokens ban pending, no logprobs, no stop strings (they need the text), and
    that it samples at all (prefill-only requests finish on the host). A grammar's mask needs the
    previous token, but only once the forward runs (Engine._launch)."""
    p = seq.params
    return (not p.prefill_only and p.logprobs is None and p.prompt_logprobs is None and not p.stop
            and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
            and seq.num_output_tokens >= p.min_tokens)


def _accept_tokens_ahead(step: _InFlight) -> None:
    """Wait for a launched step's tokens (not the steps after it) and advance its grammars by them."""
    if step.copied is not None:
        step.copied.synchronize()
    for row, token in zip(step.sample_rows, step.host_tokens.tolist()):
        accept_ahead(step.batch.seqs[row], token)


def _ends_by_length(seq: Sequence) -> bool:
    """Whether the token being sampled for seq (not yet appended) is certainly its last: the same
    length check as Engine._append_token's, one token early."""
    limit = seq.params.max_tokens or seq.max_len
    return seq.num_output_tokens + 1 >= limit or seq.num_tokens + 1 >= seq.max_len


def _detokenize_pending(seq: Sequence, detokenizer: IncrementalDetokenizer, upto: int | None = None) -> str:
    """Feed the detokenizer the tokens it has not seen (up to token index `upto`); returns the new text."""
    delta = detokenizer.add_tokens(seq.token_ids[len(detokenizer.all_ids) : upto])
    seq.text += delta
    return delta


def _entry(values: list[float], ids: list[int], rank: int, tokenizer) -> LogprobsEntry:
    """values/ids: the chosen token first, then the top alternatives (which may include it)."""
    entry: LogprobsEntry = {}
    for position, (token, value) in enumerate(zip(ids, values)):
        if token not in entry:
            decoded = tokenizer.decode([token], skip_special_tokens=False) if tokenizer else None
            entry[token] = Logprob(value, rank if position == 0 else position, decoded)
    return entry


def _logprobs_entry(sampled: SamplerOutput, row: int, num_top: int | None, tokenizer) -> LogprobsEntry | None:
    if sampled.logprobs is None or num_top is None:
        return None
    return _entry(sampled.logprobs[row, : 1 + num_top].tolist(),
                  sampled.logprob_token_ids[row, : 1 + num_top].tolist(), int(sampled.ranks[row]), tokenizer)
