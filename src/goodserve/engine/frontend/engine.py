"""The engine: add requests, call step() until done. The scheduler decides, the executor's worker
runs the step and samples, the output processor turns tokens into outputs.

One step: schedule (plain data) -> execute_model (inputs, forward) -> sample_tokens (with the grammar
masks the engine fills meanwhile) -> the scheduler's update from the output (computed tokens, the
sampled ones appended, stop tokens and lengths) -> the output processor's (text, stop strings,
logprobs); the engine applies the finishes each returns. Every stage is timed, so the cost of Python
around the GPU is visible (EngineStats).

Async scheduling: while steps replay CUDA graphs and every sequence in them samples on the device
alone, step N+1 is launched before step N's tokens reach the host (its decode inputs are step N's
tokens, which the runner keeps on the device; it may also admit waiting requests), and step N's
tokens are appended and checked while the device runs N+1. A sequence that stopped at N wastes its
slot in N+1; preemption and unfinished prefill chunks flush first.

Pipeline parallelism (with pipeline_micro_batches): the engine keeps a step in flight for each
stage, each over sequences the others do not hold (micro-batches), so that stage 0 computes one
while the next stages compute the ones before it; it finishes the oldest once the stages are full
(or nothing else can run). Otherwise, and with a speculator (a step's drafts wait on the step
before), the stages take one step at a time.

Speculative decoding (engine/spec_decode/): each step carries the speculator's plan for the next
(which rows draft, how many); once it is computed, the drafts are proposed: by the runner's
drafter (a draft model, in the worker: they come back in the step's output) or by the host
proposer (n-gram, lookahead) as the step is recorded. The next step gives each sequence what its
budget leaves room for, the runner samples at each of their positions and keeps the confirmed
ones, the scheduler rolls back the rest (update_from_output). Neither a step with drafts nor one
with a plan is run ahead of: the next step's inputs depend on how many were kept, and its drafts
continue tokens the host must have seen.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from goodserve.config import EngineConfig
from goodserve.engine.setup.config_resolution import resolve_for_device, torch_dtype, with_overrides
from goodserve.engine.worker.executor import make_executor
from goodserve.engine.frontend.grammar import accept_tokens_ahead, grammar_bitmask
from goodserve.engine.frontend.input_processor import InputProcessor, sequence_id
from goodserve.engine.worker.isolation import find_culprits
from goodserve.engine.setup.kv_cache import kv_read_ratio, kv_storage_dtype
from goodserve.engine.core.kv_cache_manager import KVCacheManager
from goodserve.engine.setup.kv_groups import kv_groups
from goodserve.engine.frontend.output_processor import OutputProcessor, catch_up_text
from goodserve.engine.frontend.request import Request
from goodserve.engine.seam.runner_output import ModelRunnerOutput, PendingOutput
from goodserve.engine.core.scheduler import Scheduler
from goodserve.engine.seam.scheduler_output import NewRequestData, SchedulerOutput
from goodserve.engine.core.sequence import Sequence
from goodserve.engine.spec_decode.policy import Speculator, verify_cost
from goodserve.engine.spec_decode.proposer import make_proposer
from goodserve.engine.core.stats import EngineStats, StepLog, engine_stats
from goodserve.engine.core.step_trace import StepTrace
from goodserve.engine.core.step_time_model import StepTimeModel, step_shape
from goodserve.engine.core.step_update import Finish
from goodserve.errors import EngineDeadError, InvalidRequestError
from goodserve.hardware import HARDWARE, hardware_for_device
from goodserve.outputs import RequestOutput
from goodserve.sampling_params import SamplingParams

logger = logging.getLogger("goodserve.engine")


@dataclass
class _Step:
    """A launched step: its plain-data decision, the sequences of its rows, its pending output."""

    out: SchedulerOutput
    seqs: list[Sequence]
    pending: PendingOutput
    launched: float  # time.perf_counter() at launch
    may_run_ahead: bool  # the next step is launched before this one's tokens are read, if it replays a graph
    advanced: bool = False  # its computed tokens were counted before its output was read (it ran ahead)


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        config = resolve_for_device(with_overrides(config, overrides))
        self.executor = make_executor(config)
        info = self.executor.info
        self.config, self.spec, self.tokenizer = info.config, info.spec, info.tokenizer
        self.device, self.dtype = torch.device(self.config.device), torch_dtype(self.config)
        self.max_model_len = self.config.max_model_len
        # quantize_lm_head is not in it: lm_head computes logits from the hidden states, never K/V.
        c = self.config
        salt = f"{info.revision}|{c.kv_cache_dtype}|{c.quantization}|{c.quantized_checkpoint}|{c.quantization_awq}"
        self.kv = KVCacheManager(c.num_kv_blocks, c.block_size, c.enable_prefix_caching, salt.encode(),
                                 windows=kv_groups(self.spec, c).windows)
        speculator = Speculator(c, make_proposer(c), verify_cost(c, info.native_decode)) \
            if c.speculative_method else None
        self.scheduler = Scheduler(c, self.kv, speculator, self._step_time_model(), info.eos_token_ids)
        self.inputs = InputProcessor(c, self.spec, self.tokenizer)
        self.outputs = OutputProcessor(self.tokenizer)
        self.requests: dict[str, Request] = {}
        self._reserved: dict[str, Request] = {}  # requests whose blocks another engine's K/V is filling
        # News for the runner, sent with the next step launched.
        self._new: list[NewRequestData] = []
        self._finished: list[str] = []
        self._inflight: _Step | None = None
        # Pipeline micro-batches: the steps in the stages, oldest first (None: one step at a time)
        micro_batches = c.pipeline_parallel_size > 1 and c.pipeline_micro_batches and self.scheduler.speculator is None
        self._stages: deque[_Step] | None = deque() if micro_batches else None
        self.steps = StepLog()
        self._last_recorded = 0.0  # perf_counter() when the last step's output was recorded
        self.trace = StepTrace(c.step_trace) if c.step_trace else None

    def _step_time_model(self) -> StepTimeModel:
        """The scheduler's step-time model, with the roofline's priors for a decode row and a token of
        context on a GPU the hardware table knows (a CPU step's fixed cost is the host's, not a weight
        read: no priors there). Quantized weights count at the model dtype, as in kv_read_ratio: the
        priors are then low, and the measured steps correct them."""
        if self.device.type != "cuda":
            return StepTimeModel()
        kv_prior = kv_read_ratio(self.spec, kv_storage_dtype(self.config, self.dtype), self.dtype)
        key = hardware_for_device("cuda", torch.cuda.get_device_name(self.device))
        row_prior = HARDWARE[key].decode_row_ratio(str(self.dtype).removeprefix("torch."), self.dtype.itemsize) \
            if key else 0.0
        return StepTimeModel(kv_read_ratio=kv_prior, row_compute_ratio=row_prior)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self.requests or request_id in self._reserved:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self._register(self.inputs.make_request(request_id, prompt, params, arrival_time))

    def _register(self, request: Request) -> None:
        self.requests[request.request_id] = request
        params = request.seqs[0].params
        for seq in request.seqs:
            self._new.append(NewRequestData(seq.seq_id, params, seq.index, request.prompt_token_ids))
        # n > 1 with prefix caching: the other samples wait until the first has cached the prompt.
        sharing = len(request.seqs) > 1 and self.config.enable_prefix_caching
        request.pending = request.seqs[1:] if sharing else []
        for seq in request.seqs[:1] if sharing else request.seqs:
            self.scheduler.add(seq)

    # ---- prefill here, decode elsewhere (engine/disagg/kv_transfer.py moves the blocks) --------------
    def add_prefill_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """A request whose blocks outlive its finish (its first token: max_tokens=1), until
        held_kv() was sent and release_held() gives them back."""
        if params.n != 1:
            raise InvalidRequestError("a request whose KV moves to another engine has n = 1")
        self.add_request(request_id, prompt, params)
        self.kv.hold(sequence_id(request_id, 0))

    def held_kv(self, request_id: str) -> tuple[list[int], int]:
        """A finished prefill request's blocks, and the tokens whose K/V they hold."""
        return self.kv.held.get(sequence_id(request_id, 0), ([], 0))

    def release_held(self, request_id: str) -> None:
        self.kv.release_held(sequence_id(request_id, 0))

    def reserve_decode_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                               arrival_time: float | None = None) -> Request | None:
        """Blocks for the prompt's K/V but its last token's, which another engine computed and which
        anyone may write (reserved_blocks) while this engine steps on: the request is not scheduled
        until admit_decode_request, or gives them back with release_decode_request. None: no room now."""
        if request_id in self.requests or request_id in self._reserved:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if params.n != 1:
            raise InvalidRequestError("a request whose KV comes from another engine has n = 1")
        request = self.inputs.make_request(request_id, prompt_token_ids, params, arrival_time)
        if not self.kv.allocate(request.seqs[0], len(prompt_token_ids) - 1):
            return None
        self._reserved[request_id] = request
        return request

    def reserved_blocks(self, request: Request) -> list[int]:
        return self.kv.block_table(request.seqs[0].seq_id)

    def admit_decode_request(self, request: Request) -> None:
        """Its blocks hold the K/V: it is scheduled as a prefix-cache hit would be (the last prompt token,
        computed here, samples the first output token)."""
        del self._reserved[request.request_id]
        seq = request.seqs[0]
        seq.num_computed_tokens = seq.num_prompt_tokens - 1
        self._register(request)

    def release_decode_request(self, request: Request) -> None:
        del self._reserved[request.request_id]
        self.kv.free(request.seqs[0], finished=True)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                catch_up_text(request.samples[seq.index], seq.token_ids)
                self._finish(seq, Finish("abort"))
        return request.output()

    @property
    def micro_batches(self) -> bool:
        """Whether the pipeline stages work on micro-batches at once (what engine_config_info reports:
        the configured switch, where pipeline parallelism and no speculator let it apply)."""
        return self._stages is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None or bool(self._stages)

    # ---- one step ------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one step; return the outputs of the requests it advanced (cumulative), or with
        finished_only only of those it finished: building a long request's output every step costs
        time proportional to its length, which offline callers need not pay."""
        stream_text = not finished_only
        if self._stages is not None:
            changed = self._step_stages(stream_text)
        elif self._inflight is not None:
            changed = self._step_pipelined(stream_text)
        else:
            out = self._schedule()
            if out is None:
                return []
            changed = self._run(out, [self.scheduler.seqs[seq_id] for seq_id in out.seq_ids], stream_text)
        t0 = time.perf_counter()
        outputs = self.outputs.collect(self.requests, changed, finished_only)
        self.steps.output += time.perf_counter() - t0
        return outputs

    def _schedule(self, in_flight: list[Sequence] | None = None,
                  busy: list[Sequence] | None = None) -> SchedulerOutput | None:
        t0 = time.perf_counter()
        out = self.scheduler.schedule(in_flight, busy)
        self.steps.schedule += time.perf_counter() - t0
        if not out:
            return None
        self.steps.observe_step(out.num_tokens, len(out))
        return out

    def _propose(self, step: _Step, output: ModelRunnerOutput) -> None:
        """Drafts for the rows the step planned, from the tokens it appended, for the sequences still
        running: the runner's drafter's, or the host proposer's now (both counted as scheduling
        time). No step is in flight: none is launched ahead of a step with a plan."""
        t0 = time.perf_counter()
        self.scheduler.speculator.propose_next(step.out, output, self.scheduler.seqs, len(self.scheduler.running))
        self.steps.schedule += time.perf_counter() - t0 + output.propose_s

    def _run(self, out: SchedulerOutput, seqs: list[Sequence], stream_text: bool) -> set[str]:
        """Launch the step; finish it now, or leave it in flight and finish it with the next launch."""
        try:
            step = self._launch(out, seqs)
            output = None if step.may_run_ahead and step.pending.replayed_graph else step.pending.result()
        except EngineDeadError:  # a lost worker process: no request caused it, none can run
            raise
        except Exception as exc:  # a failed step fails the requests that cause it, never the engine
            return self._isolate(out, seqs, exc, stream_text)
        if output is not None:
            return self._record(step, output, stream_text)
        self.scheduler.advance(out)  # its K/V are computed when the next step reads them
        step.advanced = True
        self._inflight = step
        return self._step_pipelined(stream_text)

    def _step_stages(self, stream_text: bool) -> set[str]:
        """Pipeline parallelism: launch steps until each stage has one in flight (or no sequence is
        left to run), then finish the oldest."""
        while len(self._stages) < self.config.pipeline_parallel_size:
            out = self._schedule(busy=[seq for step in self._stages for seq in step.seqs])
            if out is None:
                break
            self.steps.num_pipelined_steps += bool(self._stages)
            seqs = [self.scheduler.seqs[seq_id] for seq_id in out.seq_ids]
            try:
                self._stages.append(self._launch(out, seqs))
            except EngineDeadError:
                raise
            except Exception as exc:  # failed at once (its inputs): isolate its culprit now
                return self._isolate(out, seqs, exc, stream_text)
        if not self._stages:
            return set()
        step = self._stages.popleft()
        try:
            output = step.pending.result()
        except EngineDeadError:
            raise
        except Exception as exc:
            return self._isolate(step.out, step.seqs, exc, stream_text)
        return self._record(step, output, stream_text)

    def _launch(self, out: SchedulerOutput, seqs: list[Sequence], previous: _Step | None = None,
                trial: bool = False) -> _Step:
        launched = time.perf_counter()
        out.new_requests, out.finished_seq_ids = self._new, self._finished
        self.executor.execute_model(out)
        sampling = [seq for seq, samples in zip(seqs, out.samples) if samples]
        if previous is not None and any(seq.grammar is not None for seq in sampling):
            accept_tokens_ahead(previous.seqs, previous.pending.result())  # the forward runs meanwhile
        grammar = grammar_bitmask(sampling, pinned=self.device.type == "cuda")
        ahead = not trial and self._may_run_ahead(out, seqs)
        step = _Step(out, seqs, self.executor.sample_tokens(grammar, trial, ahead), launched, ahead)
        if not trial:
            self._new, self._finished = [], []
        return step

    def _may_run_ahead(self, out: SchedulerOutput, seqs: list[Sequence]) -> bool:
        """Whether the next step may launch before this one's tokens reach the host, should this one
        replay a graph (known once launched). The executor is told before: a worker process then
        holds the step's output until the next step has launched (engine/worker/executor.py). Pipeline
        micro-batches: always (their sequences are no other step's)."""
        if self._stages is not None:
            return True
        return (self.config.async_scheduling and out.all_sample and not out.draft_token_ids
                and not out.num_next_drafts and all(seq.samples_on_device for seq in seqs))

    def _step_pipelined(self, stream_text: bool) -> set[str]:
        """Launch the step after the one in flight (if the scheduler can decide it without that
        step's tokens), then finish the one in flight while the device runs the next."""
        current, self._inflight = self._inflight, None
        try:
            self._launch_ahead(current)
            changed = self._record(current, current.pending.result(), stream_text)
            if self._inflight is not None:  # its input tokens are on the host now: register full blocks
                self.scheduler.advance(self._inflight.out)
                self._inflight.advanced = True
            return changed
        except EngineDeadError:  # a lost worker process: no request caused it, none can run
            raise
        except Exception as exc:
            steps = [current] + ([self._inflight] if self._inflight is not None else [])
            self._inflight = None
            logger.exception("async step failed; aborting its %d sequences", len(current.seqs))
            if self.device.type == "cuda":  # nothing queued may still read the host buffers
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize(self.device)
            return set().union(*(self._fail_all(step.seqs, exc) for step in steps))

    def _launch_ahead(self, current: _Step) -> None:
        """If launching fails, the step is dropped: nothing advanced, its blocks are the ones the
        next step allocates anyway, and the next step, synchronous, runs its sequences again and
        isolates the request that broke it."""
        ahead = current.out.all_sample and not current.out.num_next_drafts
        out = self._schedule(in_flight=current.seqs) if ahead else None
        if out is None:
            return
        self.steps.num_pipelined_steps += 1
        seqs = [self.scheduler.seqs[seq_id] for seq_id in out.seq_ids]
        try:
            self._inflight = self._launch(out, seqs, previous=current)
        except EngineDeadError:
            raise
        except Exception as exc:
            logger.warning("launching a step ahead failed (%s: %s); its sequences run synchronously next",
                           type(exc).__name__, exc)

    # ---- failures ------------------------------------------------------------------------
    def _isolate(self, out: SchedulerOutput, seqs: list[Sequence], error: Exception, stream_text: bool) -> set[str]:
        """The step raised before anything advanced: fail the requests whose sequences fail alone,
        with their own errors, then run the rest as this step."""
        logger.warning("step of %d sequences failed (%s: %s); isolating its culprit", len(seqs),
                       type(error).__name__, error)

        def trial(part: SchedulerOutput, rows: list[int]) -> None:
            self._launch(part, [seqs[row] for row in rows], trial=True).pending.result()

        for row, exc in find_culprits(out, error, trial):
            logger.error("request %s failed its step: %s: %s", seqs[row].request_id, type(exc).__name__, exc,
                         exc_info=exc)
            self._fail_request(seqs[row].request_id, exc)
        rows = [row for row, seq in enumerate(seqs) if not seq.is_finished]
        changed = {seq.request_id for seq in seqs}
        if rows:
            rest, rest_seqs = out.select(rows), [seqs[row] for row in rows]
            try:
                step = self._launch(rest, rest_seqs)
                output = step.pending.result()
            except Exception as exc:  # the failure needs the whole batch (none failed alone): fail it
                logger.exception("step failed again without its culprits; aborting its %d sequences", len(rows))
                return changed | self._fail_all(rest_seqs, exc)
            changed |= self._record(step, output, stream_text)
        return changed

    def _fail_all(self, seqs: list[Sequence], exc: Exception) -> set[str]:
        for seq in seqs:
            self._fail_request(seq.request_id, exc)
        return {seq.request_id for seq in seqs}

    def _fail_request(self, request_id: str, exc: Exception) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        request.error = request.error or f"{type(exc).__name__}: {exc}"
        for seq in request.seqs:
            if not seq.is_finished:
                self._finish(seq, Finish("abort"))

    # ---- after the step ------------------------------------------------------------------
    def _record(self, step: _Step, output: ModelRunnerOutput, stream_text: bool) -> set[str]:
        """A computed step's output: the scheduler's update (tokens appended, stop tokens, lengths),
        then the output processor's (text, stop strings, logprobs); the finishes and failures each
        returns are applied here. An error in one sequence's bookkeeping fails its request alone."""
        t0 = time.perf_counter()
        # from its launch, or, pipelined, from the step before it reaching the host: the interval at
        # which its decodes got their tokens (the drafter's proposals after them are the next step's)
        seconds = t0 - max(step.launched, self._last_recorded) - output.propose_s
        shape = step_shape(step.out)
        if self.trace is not None:
            self.trace.record(step.out, shape, time.time(), seconds, step.pending.replayed_graph,
                              step.launched < self._last_recorded, self.scheduler)
        self.scheduler.step_time.observe(*shape, seconds)
        self._last_recorded = t0
        update = self.scheduler.update_from_output(step.out, output, step.advanced)
        self._release_siblings(step.seqs)
        processed = self.outputs.process(self.requests, step.out, step.seqs, update, output, stream_text)
        self._ended(update.finished)
        for seq, finish in processed.finished:
            self._finish(seq, finish)
        for seq, exc in processed.failed:
            self._finish(seq, Finish("abort"))
            self._fail_request(seq.request_id, exc)
        self.steps.prepare += output.prepare_s
        self.steps.forward += output.forward_s
        self.steps.sample += output.sample_s
        self.steps.num_context_parallel_steps += output.context_parallel
        if step.out.draft_token_ids:
            self.steps.num_verify_steps += 1
            self.steps.num_graphed_verify_steps += step.pending.replayed_graph
        self.steps.detokenize += time.perf_counter() - t0
        if self.scheduler.speculator is not None:
            self._propose(step, output)
        return {seq.request_id for seq in step.seqs}

    def _finish(self, seq: Sequence, finish: Finish) -> None:
        """End seq; one the scheduler ended this step takes this reason instead (a stop string before
        its stop token or length, a failure of its bookkeeping)."""
        if seq.is_finished:
            seq.finish_reason, seq.stop_reason = finish.reason, finish.stop_reason
            return
        self.scheduler.finish(seq, finish.reason, finish.stop_reason)
        self._ended([seq])

    def _ended(self, seqs: list[Sequence]) -> None:
        """Sequences the scheduler let go: their finish time; the runner drops their state next step."""
        now = time.time()
        for seq in seqs:
            seq.metrics.finished_time = now
            self._finished.append(seq.seq_id)

    def _release_siblings(self, seqs: list[Sequence]) -> None:
        """n > 1: the other samples start once the first has its prompt cached (it may have finished in
        the step that computed it, its first token its last)."""
        for seq in seqs:
            request = self.requests.get(seq.request_id)
            if request is not None and request.pending and (
                    seq.is_finished or seq.num_computed_tokens >= seq.num_prompt_tokens):
                for sibling in request.pending:
                    self.scheduler.add(sibling)
                request.pending = []

    # ---- introspection -------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return engine_stats(self.scheduler, self.kv, self.steps)

