"""What the engine reports about itself: queue and pool state, and where each step's host time goes."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the server's metrics read this module's plain data without torch
    from goodserve.engine.core.kv_cache_manager import KVCacheManager
    from goodserve.engine.core.scheduler import Scheduler


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
    # The step-time model's (engine/core/step_time_model.py) EWMA of |measured - predicted| / predicted
    # step time: what the "slo" policy's planning margin grows with.
    step_time_relative_error: float
    # Speculative decoding (engine/spec_decode/), vLLM's counts: verifications (one sequence's
    # proposals checked in one step), tokens proposed, tokens kept, and per draft position j the
    # verifications that kept the draft at j (kept drafts are a prefix, so the list falls).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    num_verify_steps: int = 0  # steps that verified drafts
    num_graphed_verify_steps: int = 0  # of those, the ones that replayed a CUDA graph
    num_context_parallel_steps: int = 0  # steps whose tokens were split over the context-parallel ranks
    # Tokens per step: the sum, and steps per ITERATION_TOKEN_BUCKETS bucket (the last: larger)
    step_tokens_total: int = 0
    step_tokens_counts: tuple[int, ...] = ()


# Tokens per step, as vLLM's iteration_tokens_total histogram buckets them (upper bounds).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class StepLog:
    """The steps so far: how many, the last one's size, how many tokens each took (counts per
    ITERATION_TOKEN_BUCKETS bucket, the last for larger), and host seconds per stage, summed."""

    num_steps: int = 0
    step_tokens_total: int = 0
    step_tokens_counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))
    num_pipelined_steps: int = 0
    num_verify_steps: int = 0
    num_graphed_verify_steps: int = 0
    num_context_parallel_steps: int = 0
    last_batch_tokens: int = 0
    last_batch_seqs: int = 0
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    detokenize: float = 0.0
    output: float = 0.0

    def observe_step(self, num_tokens: int, num_seqs: int) -> None:
        self.num_steps += 1
        self.last_batch_tokens, self.last_batch_seqs = num_tokens, num_seqs
        self.step_tokens_total += num_tokens
        self.step_tokens_counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1


def engine_stats(scheduler: Scheduler, kv: KVCacheManager, steps: StepLog) -> EngineStats:
    return EngineStats(
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        num_kv_blocks=kv.num_blocks, num_used_kv_blocks=kv.num_used_blocks,
        kv_cache_usage=kv.num_used_blocks / kv.num_blocks,
        prefix_cache_queries=kv.counters.queries, prefix_cache_hits=kv.counters.hits,
        num_preemptions=scheduler.num_preemptions, num_steps=steps.num_steps,
        num_pipelined_steps=steps.num_pipelined_steps, last_batch_tokens=steps.last_batch_tokens,
        step_tokens_total=steps.step_tokens_total, step_tokens_counts=tuple(steps.step_tokens_counts),
        last_batch_seqs=steps.last_batch_seqs, schedule_seconds_total=steps.schedule,
        prepare_seconds_total=steps.prepare, forward_seconds_total=steps.forward,
        sample_seconds_total=steps.sample, detokenize_seconds_total=steps.detokenize,
        output_seconds_total=steps.output, num_verify_steps=steps.num_verify_steps,
        num_graphed_verify_steps=steps.num_graphed_verify_steps,
        num_context_parallel_steps=steps.num_context_parallel_steps,
        step_time_relative_error=scheduler.step_time.relative_error,
        **_spec_decode_counts(scheduler.speculator),
    )


def _spec_decode_counts(speculator) -> dict:
    if speculator is None:
        return {}
    return dict(spec_decode_num_drafts=speculator.num_drafts,
                spec_decode_num_draft_tokens=speculator.num_draft_tokens,
                spec_decode_num_accepted_tokens=speculator.num_accepted_tokens,
                spec_decode_num_accepted_tokens_per_pos=tuple(speculator.num_accepted_per_pos))
