"""Decides, each step, which sequences run and how many of their tokens.

Token-budget scheduling in the manner of vLLM v1: there is no separate prefill or decode phase. A
sequence needs (its tokens) - (tokens whose K/V are cached) tokens computed: 1 when decoding, the
rest of its prompt when prefilling. Running sequences are served first, then waiting ones, until
the step's token budget (max_num_batched_tokens) or the sequence cap (max_num_seqs) is reached. With
chunked prefill a long prompt takes whatever budget is left and finishes in later steps, so decodes
are never stalled behind it. When the KV pool runs out, the newest running sequence is preempted:
its blocks are freed and it is recomputed later (its prefix may well still be cached).

The batching policy only gates admission: "continuous" admits whenever there is room; "static"
admits a new batch only once the previous one has entirely finished; "dynamic" also waits for the
batch to fill up to max_num_seqs or for the oldest request to have waited max_wait_ms; "makespan"
admits the longest requests first and spreads the rest over the longest one's steps, to finish an
offline batch of known lengths soonest (engine/makespan.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from goodserve.config import EngineConfig
from goodserve.engine.block_pool import BlockPool
from goodserve.engine.makespan import MakespanAdmission, longest_first_key
from goodserve.engine.sequence import Sequence, SequenceStatus
from goodserve.engine.waiting_queue import WaitingQueue


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Async scheduling: a step scheduled before the previous step's tokens reached the host. Its first
    # num_ahead sequences decode that step's token (still on the device), at position num_computed_tokens.
    num_ahead: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


def _decodes_first(seq: Sequence) -> tuple:
    return (seq.num_uncomputed_tokens > 1, *seq.priority_key())


class Scheduler:
    def __init__(self, config: EngineConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        makespan = config.scheduler_policy == "makespan"
        self.makespan = MakespanAdmission(config.max_num_batched_tokens) if makespan else None
        self.waiting = WaitingQueue(longest_first_key if makespan else Sequence.priority_key)

    # ---- queue management ----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.add(seq)
        if self.makespan is not None:
            self.makespan.add_waiting(seq)

    def _leave_waiting(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        if self.makespan is not None:
            self.makespan.remove_waiting(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Take seq out of the queues and release its blocks (finished, aborted or failed)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:  # waiting, or not handed over by the engine yet (in neither queue)
            self._leave_waiting(seq)
        self.pool.free_sequence(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        if not self._admits_any_step and self._next_batch_ready():
            self._admit_whole_batch()
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        if self._admits_any_step and not batch.preempted and self.waiting:
            self._schedule_waiting(batch, min(budget, self._admission_allowance(batch.num_tokens)))
        return batch

    @property
    def _admits_any_step(self) -> bool:
        """Continuous batching and makespan admit at any step; static and dynamic between batches."""
        return self.config.scheduler_policy in ("continuous", "makespan")

    def _admission_allowance(self, num_scheduled: int) -> int:
        """Tokens new requests may take this step, besides num_scheduled for the running ones."""
        if self.makespan is None:
            return self.config.max_num_batched_tokens
        return self.makespan.allowance(self.running, num_scheduled)

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        """Decodes first (the attention kernels take a batch's leading one-token rows apart), then
        unfinished prompts in priority order."""
        for seq in sorted(self.running, key=_decodes_first):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.pool.allocate(seq, num_new):
                victim = self._lowest_priority_running(exclude=batch.seqs)
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int, admissible=None) -> None:
        """Admit waiting sequences in order while the budget lasts; `admissible`, when given, stops
        at the first sequence it refuses."""
        while budget > 0 and len(self.running) < self.config.max_num_seqs and self.waiting:
            seq = self.waiting.peek()
            if admissible is not None and not admissible(seq):
                break
            if not seq.block_table:
                self.pool.match_prefix(seq)
            num_new = seq.num_uncomputed_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    self._release_prefix(seq)
                    break
                num_new = budget
            if not self.pool.allocate(seq, num_new):
                self._release_prefix(seq)
                break
            self._start_running(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new

    def _release_prefix(self, seq: Sequence) -> None:
        """A sequence that could not be admitted gives back the cached blocks it had matched."""
        self.pool.free_sequence(seq)

    def _lowest_priority_running(self, exclude: list[Sequence]) -> Sequence:
        return max((s for s in self.running if s not in exclude), key=Sequence.priority_key)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Recompute preemption: free the blocks, requeue at the front; its tokens are kept."""
        self.running.remove(seq)
        self.pool.free_sequence(seq)
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)  # its key (priority, arrival) puts it before the requests that came after it
        batch.preempted.append(seq)

    def _next_batch_ready(self) -> bool:
        """Static and dynamic batching: a new batch starts only once the last one has finished."""
        if self.running or not self.waiting:
            return False
        if self.config.scheduler_policy == "static" or len(self.waiting) >= self.config.max_num_seqs:
            return True
        # fewer than max_num_seqs wait: a bounded scan
        oldest_wait_ms = (time.time() - min(s.arrival_time for s in self.waiting)) * 1000
        return oldest_wait_ms >= self.config.max_wait_ms

    def _admit_whole_batch(self) -> None:
        for _ in range(min(len(self.waiting), self.config.max_num_seqs)):
            seq = self.waiting.peek()
            self.pool.match_prefix(seq)
            self._start_running(seq)

    def _start_running(self, seq: Sequence) -> None:
        self._leave_waiting(seq)
        seq.status = SequenceStatus.RUNNING
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = time.time()
            seq.num_cached_tokens = seq.num_computed_tokens
        self.running.append(seq)

    def schedule_ahead(self, seqs: list[Sequence], admissible) -> ScheduledBatch | None:
        """Async scheduling: one more decode token for each of seqs, whose current step (already
        advanced) has not returned its tokens yet, then the waiting sequences the policy admits now,
        as far as `admissible` allows (the engine's test for sequences that sample on the device).
        None when the normal scheduler must decide instead (no seqs, or the pool is short and
        someone must be preempted). Blocks allocated before a refusal are the ones the next step
        would allocate anyway: they stay in the block tables."""
        if not seqs:
            return None
        for seq in seqs:
            assert seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens == seq.num_tokens
            if not self.pool.allocate(seq, 1):
                return None
        batch = ScheduledBatch(list(seqs), [1] * len(seqs), num_ahead=len(seqs))
        if self.waiting and self._admits_any_step:
            budget = min(self.config.max_num_batched_tokens - len(seqs), self._admission_allowance(len(seqs)))
            self._schedule_waiting(batch, max(budget, 0), admissible)
        return batch

    # ---- after the step ------------------------------------------------------------------
    def advance(self, batch: ScheduledBatch) -> None:
        """The runner computed the scheduled tokens: their K/V are now cached. Sequences that finished
        meanwhile (stopped or aborted while an async step ran) hold no blocks and are skipped."""
        if self.makespan is not None:
            self.makespan.advance(batch.num_tokens)
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            if seq.is_finished:
                continue
            seq.num_computed_tokens += num_new
            self.pool.register_full_blocks(seq)
