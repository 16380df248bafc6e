"""Decides, each step, which sequences run and how many of their tokens.

Token-budget scheduling in the manner of vLLM v1: there is no separate prefill or decode phase. A
sequence needs (its tokens) - (tokens whose K/V are cached) tokens computed: 1 when decoding, the
rest of its prompt when prefilling. Running sequences are served first, then waiting ones, until
the step's token budget (max_num_batched_tokens) or the sequence cap (max_num_seqs) is reached. With
chunked prefill a long prompt takes whatever budget is left and finishes in later steps, so decodes
are never stalled behind it. On the torch attention path a waiting sequence's cached prefix counts
against the budget too (_cached_reads). When the KV pool runs out, the newest running sequence is preempted:
its blocks are freed and it is recomputed later (its prefix may well still be cached). A waiting
sequence of a higher priority takes the room of running ones of a lower priority (engine/core/displacement.py).

The choices are the policy's (engine/core/scheduling_policy.py, picked by EngineConfig.scheduler_policy):
the queues' order, the step's token budgets, whether a sequence has room to join, which one is
preempted first, whether admission waits for whole batches, and the forecast the admission check
reads. The scheduler carries them out and tells the policy what entered, left and ran.

Its decision goes to the runner as plain data (engine/seam/scheduler_output.py); the sequences it decides
over stay here, with the engine. With async scheduling the engine passes the step still in flight:
its sequences' next tokens exist only on the device (placeholders), and the step scheduled ahead of
them decodes those tokens.

Speculative decoding (engine/spec_decode/): a decoding sequence may carry drafts, computed in the
same step after its last token (1 + k tokens, one row). The policy picks each one's k, then the
proposer proposes for all of them in one call (a draft model batches them), before the step is laid
out; update_from_output() rolls back the ones the runner rejected (their K/V slots are rewritten later,
their tail blocks freed). A sequence that leaves (finished, aborted, preempted) leaves the proposer too.

After the step, update_from_output() is the one way back: it advances the computed tokens, appends
the sampled ones, ends sequences at a stop token or their length, and returns what it did as data
(engine/core/step_update.py); the output processor takes it from there (text, stop strings, logprobs).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from goodserve.config import EngineConfig
from goodserve.engine.core.displacement import displaced_running
from goodserve.engine.core.forecast import Forecast
from goodserve.engine.core.kv_cache_manager import KVCacheManager
from goodserve.engine.seam.scheduler_output import SchedulerOutput
from goodserve.engine.core.scheduling_policy import make_policy
from goodserve.engine.core.sequence import Sequence, SequenceStatus
from goodserve.engine.core.step_time_model import StepTimeModel
from goodserve.engine.core.step_update import StepUpdate, append_tokens
from goodserve.engine.spec_decode.policy import Speculator, VerifyCost
from goodserve.engine.seam.drafts import BranchOutput, Drafts
from goodserve.engine.spec_decode.proposer import Proposer
from goodserve.engine.core.waiting_queue import WaitingQueue

if TYPE_CHECKING:  # the runner's output module imports torch; the scheduler needs none
    from goodserve.engine.seam.runner_output import ModelRunnerOutput


class _Decision:
    """The sequences a step computes and how many tokens each, while it is being decided."""

    def __init__(self, num_ahead: int = 0, max_rows: int | None = None, busy: frozenset[str] = frozenset()) -> None:
        self.seqs: list[Sequence] = []
        self.max_rows = max_rows  # pipeline micro-batches: each takes its share of the sequences
        self.busy = busy  # ids of sequences another micro-batch in flight computes: not this step's
        self.num_new: list[int] = []  # drafts included
        self.drafts: list[Drafts | None] = []
        self.num_ahead = num_ahead
        self.preempted = False

    @property
    def full(self) -> bool:
        return self.max_rows is not None and len(self.seqs) >= self.max_rows

    def add(self, seq: Sequence, num_new: int, drafts: Drafts | None = None) -> None:
        self.seqs.append(seq)
        self.num_new.append(num_new)
        self.drafts.append(drafts)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, proposer: Proposer | None = None,
                 step_time: StepTimeModel | None = None, verify_cost: VerifyCost | None = None,
                 eos_token_ids: list[int] | None = None) -> None:
        self.config = config
        self.eos_token_ids = eos_token_ids or []
        self.kv = kv
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}  # every unfinished sequence it was given, by id
        self.num_preemptions = 0
        self.step_time = step_time or StepTimeModel()  # the engine feeds it every step
        self.policy = make_policy(config, self.step_time)
        self.waiting = WaitingQueue(self.policy.waiting_key)
        self.speculator = Speculator(config, proposer, verify_cost) if proposer is not None else None

    # ---- queue management ----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.seqs[seq.seq_id] = seq
        self.waiting.add(seq)
        self.policy.entered_waiting(seq)

    def _leave_waiting(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        self.policy.left_waiting(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Take seq out of the queues and release its blocks (finished, aborted or failed)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:  # waiting, or not handed over by the engine yet (in neither queue)
            self._leave_waiting(seq)
        self._release_blocks(seq, finished=True)
        self.seqs.pop(seq.seq_id, None)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason

    # ---- one step ------------------------------------------------------------------------
    def schedule(self, in_flight: list[Sequence] | None = None,
                 busy: list[Sequence] | None = None) -> SchedulerOutput | None:
        """The next step. in_flight: the sequences of a launched step whose sampled tokens have not
        reached the host (async scheduling); the step is then scheduled ahead of them, or None
        when it cannot be (someone would have to be preempted: the engine finishes the step in
        flight first and asks again). busy (pipeline micro-batches): the sequences of the steps
        in flight in the stages, which this step leaves alone (neither computes nor preempts);
        it takes its share of the rest, so that the stages' steps hold about as many rows each."""
        self.policy.begin_step(self.running)
        if in_flight:
            decision = self._schedule_ahead(in_flight)
        elif busy is not None:
            decision = self._schedule_now(_Decision(max_rows=self._microbatch_rows(),
                                                    busy=frozenset(seq.seq_id for seq in busy)))
        else:
            decision = self._schedule_now()
        if decision is None:  # asked again once the step in flight is done: planned once
            self.policy.step_refused()
            return None
        if self.speculator is not None:
            self.speculator.counted_step()
        return self._output(decision)

    def may_propose(self) -> bool:
        """Whether the next step may carry drafts. A step scheduled ahead of the one in flight (async
        scheduling) cannot: its sequences' last tokens, which drafts continue, are not known yet, so
        the engine stops running ahead while this holds (the speculator's plan for the running
        sequences is not empty)."""
        return self.speculator is not None and bool(self.speculator.plan(self.running, len(self.running)))

    def _microbatch_rows(self) -> int:
        """A micro-batch's share of the sequences the stages could hold in flight together."""
        stages = self.config.pipeline_parallel_size
        return -(-min(len(self.running) + len(self.waiting), self.config.max_num_seqs) // stages) or 1

    def _schedule_now(self, decision: _Decision | None = None) -> _Decision:
        decision = decision or _Decision()
        admits_any_step = self.policy.admits_any_step
        if not admits_any_step and self.policy.next_batch_ready(self.running, self.waiting):
            self._admit_whole_batch()
        if admits_any_step:
            for victim in self._displaced_running(decision.busy):
                self._requeue(victim)
        budget = self._schedule_running(decision, self.policy.running_budget())
        if admits_any_step and not decision.preempted and self.waiting:
            allowance = self.policy.admission_allowance(self.running, sum(decision.num_new))
            self._schedule_waiting(decision, min(budget, allowance))
        return decision

    def _schedule_ahead(self, in_flight: list[Sequence]) -> _Decision | None:
        """One more decode token for each sequence of the step in flight that goes on (not finished,
        its token in flight not certainly its last), then the waiting sequences the policy admits
        now that sample on the device alone. Blocks allocated before a refusal are the ones the next
        step would allocate anyway: they stay in the block tables."""
        going_on = [seq for seq in in_flight if not seq.is_finished and not seq.ends_with_next_token()]
        if not going_on or (self.policy.admits_any_step and self._displaced_running()):
            return None
        for seq in going_on:
            if not self.kv.allocate(seq, 1):
                return None
        decision = _Decision(num_ahead=len(going_on))
        for seq in going_on:
            decision.add(seq, 1)
        if self.waiting and self.policy.admits_any_step:
            allowance = self.policy.admission_allowance(self.running, len(going_on))
            budget = min(self.config.max_num_batched_tokens - len(going_on), allowance)
            self._schedule_waiting(decision, max(budget, 0), lambda seq: seq.samples_on_device)
        return decision

    def _schedule_running(self, decision: _Decision, budget: int) -> int:
        """Decodes first (the attention kernels take a batch's leading one-token rows apart), then
        unfinished prompts, in the policy's order."""
        ordered = sorted((seq for seq in self.running if seq.seq_id not in decision.busy), key=self.policy.running_key)
        proposed = self._propose(ordered, budget)
        for seq in ordered:
            if budget == 0 or decision.full:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_own = self.policy.granted(seq, min(seq.num_uncomputed_tokens, budget))
            if num_own == 0:
                continue
            drafts = proposed.get(seq.seq_id)
            num_drafts = len(drafts.token_ids) if drafts else 0
            num_new = num_own + num_drafts
            if drafts and not self.kv.allocate(seq, num_new):  # speculation never preempts anyone
                drafts, num_new = None, num_new - num_drafts
            while not self.kv.allocate(seq, num_new):
                victim = self._lowest_priority_running(decision)
                self._preempt(victim, decision)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                decision.add(seq, num_new, drafts)
                budget -= num_new
        return budget

    def _propose(self, ordered: list[Sequence], budget: int) -> dict[str, Drafts]:
        """Drafts for the decoding sequences to verify this step, by id: each one's k with room left
        for its own token and what the sequences before it take, then one call to the proposer."""
        if self.speculator is None:
            return {}
        plan = self.speculator.plan([seq for seq in ordered if seq.num_uncomputed_tokens == 1], len(self.running))
        wanted = []
        for seq in ordered:
            if budget <= 0:
                break
            k = self.speculator.drafts_for(seq, plan[seq.seq_id], budget - 1) if seq.seq_id in plan else 0
            if k:
                wanted.append((seq, k))
            budget -= min(seq.num_uncomputed_tokens, budget) + k
        return self.speculator.propose(wanted) if wanted else {}

    def _schedule_waiting(self, decision: _Decision, budget: int, admissible=None) -> None:
        """Admit waiting sequences in order while the budget lasts; `admissible`, when given, stops
        at the first sequence it refuses."""
        self.policy.before_admitting(self.waiting)
        admitted, passed_over = 0, []
        while budget > 0 and self.waiting and not decision.full:
            seq = self.waiting.peek()
            if not self.policy.has_room(seq, len(self.running), self.policy.running_tokens) \
                    or (admissible is not None and not admissible(seq)):
                break
            if passed_over and seq.request_id == passed_over[-1].request_id:  # a copy of the one passed over
                self.waiting.remove(seq)
                passed_over.append(seq)
                continue
            matched = seq.seq_id not in self.kv.tables  # else it holds K/V computed elsewhere (kv_transfer.py)
            if matched:
                seq.num_computed_tokens = self.kv.match_prefix(seq)
            num_new = self.policy.granted(seq, min(seq.num_uncomputed_tokens, budget))
            whole = num_new == seq.num_uncomputed_tokens
            cost = num_new + self._cached_reads(seq)
            if admitted and cost > budget:  # its cached prefix does not fit what is left: the next may
                if matched:
                    self._release_blocks(seq)
                self.waiting.remove(seq)
                passed_over.append(seq)
                continue
            if num_new == 0 or not (whole or self.config.enable_chunked_prefill) or not self.kv.allocate(seq, num_new):
                self._release_blocks(seq)
                break
            self._start_running(seq)
            self.policy.joined(seq)
            decision.add(seq, num_new)
            budget, admitted = max(budget - cost, 0), admitted + 1
        for seq in passed_over:  # back in their places, first in line next step
            self.waiting.add(seq)

    def _cached_reads(self, seq: Sequence) -> int:
        """The cached tokens an admitted sequence's prompt rows read besides its new ones, which its
        step pays for on the torch attention path (the CPU's): there a step with prompt rows attends
        one sequence at a time over its whole context, so n copies of a prompt served by the prefix
        cache would cost a step n whole prompts' attention for a few new tokens each (8 x 128 copies:
        one step of 45 s). Counted against the step's budget, they enter over several steps, each
        bounded; the first admission of a step always goes, and one whose prefix does not fit what is
        left (with its request's other copies) is passed over for this step: a request behind them
        that fits is admitted, not held back until every copy has started."""
        return seq.num_computed_tokens if self.config.attention_backend == "torch" else 0

    def _release_blocks(self, seq: Sequence, finished: bool = False) -> None:
        """A sequence that could not be admitted (or is preempted, or finished) gives back its blocks,
        the draft model's too."""
        self.kv.free(seq, finished)
        if self.speculator is not None:
            self.speculator.release(seq)
        seq.num_computed_tokens = 0

    def _displaced_running(self, busy: frozenset[str] = frozenset()) -> list[Sequence]:
        return displaced_running(self.policy, self.running, self.waiting, self.kv, busy)

    def _lowest_priority_running(self, decision: _Decision) -> Sequence:
        """Of the running sequences neither in this step nor in a micro-batch in flight (the one that
        asks for blocks is neither, so there is always one)."""
        return max((s for s in self.running if s not in decision.seqs and s.seq_id not in decision.busy),
                   key=self.policy.victim_key)

    def _preempt(self, seq: Sequence, decision: _Decision) -> None:
        self._requeue(seq)
        decision.preempted = True

    def _requeue(self, seq: Sequence) -> None:
        """Recompute preemption: free the blocks, requeue at the front; its tokens are kept."""
        self.running.remove(seq)
        self.policy.left(seq)
        self._release_blocks(seq)
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)  # its key (priority, arrival) puts it before the requests that came after it

    def _admit_whole_batch(self) -> None:
        for _ in range(min(len(self.waiting), self.config.max_num_seqs)):
            seq = self.waiting.peek()
            seq.num_computed_tokens = self.kv.match_prefix(seq)
            self._start_running(seq)

    def _start_running(self, seq: Sequence) -> None:
        self._leave_waiting(seq)
        seq.status = SequenceStatus.RUNNING
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = time.time()
            seq.num_cached_tokens = seq.num_computed_tokens
        self.running.append(seq)

    def _output(self, decision: _Decision) -> SchedulerOutput:
        """The decision as plain data: each row's tokens to compute, its block table, whether it samples."""
        out = SchedulerOutput(num_ahead=decision.num_ahead)
        tables = self.kv.tables
        for row, (seq, num_new, drafts) in enumerate(zip(decision.seqs, decision.num_new, decision.drafts)):
            draft_ids = drafts.token_ids if drafts else []
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new - len(draft_ids)
            ahead = row < decision.num_ahead
            out.seq_ids.append(seq.seq_id)
            out.num_new_tokens.append(num_new)
            out.num_computed_tokens.append(start)
            out.token_ids.append([] if ahead else seq.token_ids[start:end] + draft_ids)
            out.block_tables.append(list(tables[seq.seq_id]))
            out.samples.append(ahead or (end == seq.num_tokens and not seq.params.prefill_only))
            if draft_ids:
                out.draft_token_ids[row] = draft_ids
                if drafts.probs is not None:
                    out.draft_probs[row] = drafts.probs
            if drafts and drafts.branch is not None:
                out.branches[row] = drafts.branch
            out.num_output_tokens.append(seq.num_output_tokens)
            if seq.counts_output_tokens:
                out.penalty_token_ids[row] = seq.output_token_ids
        return out

    def forecast(self) -> Forecast:
        """What a new request can expect, by the policy: for the admission check (engine/frontend/admission.py)."""
        return self.policy.forecast(self.running)

    # ---- after the step ------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, output: ModelRunnerOutput, advanced: bool = False) -> StepUpdate:
        """A computed step's output: advance it (unless that was done at its launch, for a step run
        ahead of its tokens), end the prefill-only sequences whose prompt is computed, append each
        sampled row's kept tokens up to a stop token or its length. Sequences that finished meanwhile
        (aborted, or stopped the step before while this one ran ahead) are skipped."""
        if not advanced:
            self.advance(out, _num_rejected(out, output), output.branches)
        update = StepUpdate()
        for seq_id in out.seq_ids:
            seq = self.seqs.get(seq_id)
            if seq is not None and seq.params.prefill_only and seq.num_computed_tokens >= seq.num_prompt_tokens:
                self.finish(seq, "length")
                update.finished.append(seq)
        for i, (row, tokens) in enumerate(zip(output.sample_rows, output.token_ids)):
            seq = self.seqs.get(out.seq_ids[row])
            if seq is None:
                continue
            count, finish = append_tokens(seq, tokens, self.eos_token_ids)
            update.appended.append((i, seq, count))
            if finish is not None:
                self.finish(seq, finish.reason, finish.stop_reason)
                update.finished.append(seq)
        return update

    def advance(self, out: SchedulerOutput, num_rejected: dict[int, int] | None = None,
                branches: dict[int, BranchOutput] | None = None) -> None:
        """The runner computed the scheduled tokens: their K/V are now cached, except the
        num_rejected[row] last drafts of a speculating row, rolled back (its tokens, appended after
        this by update_from_output, are the kept drafts and one more; a row with a side branch hands its results,
        branches[row], to the proposer). Sequences that finished meanwhile (stopped or aborted while
        an async step ran) hold no blocks and are skipped."""
        self.policy.step_ran(out.num_tokens)
        for row, (seq_id, num_new) in enumerate(zip(out.seq_ids, out.num_new_tokens)):
            seq = self.seqs.get(seq_id)
            if seq is None:
                continue
            rejected = num_rejected.get(row, 0) if num_rejected else 0
            seq.num_computed_tokens += num_new - rejected
            if row in out.draft_token_ids:
                num_drafts = len(out.draft_token_ids[row])
                self.speculator.observe(seq, num_drafts, num_drafts - rejected)
                self.kv.free_tail(seq)
            if branches and row in branches:
                self.speculator.learn(seq, out.draft_token_ids.get(row, []), out.branches[row], branches[row])
            self.kv.register_full_blocks(seq)


def _num_rejected(out: SchedulerOutput, output: ModelRunnerOutput) -> dict[int, int]:
    """Per row that verified drafts, how many the runner rejected (it keeps the rest and adds one)."""
    return {row: len(out.draft_token_ids[row]) + 1 - len(tokens)
            for row, tokens in zip(output.sample_rows, output.token_ids) if row in out.draft_token_ids}
