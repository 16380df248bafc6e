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

Its decision goes to the runner as plain data (engine/core/step_decision.py); the sequences stay
here, with the engine. With async scheduling the engine passes the step still in flight: its
sequences' next tokens exist only on the device, and the step scheduled ahead of them decodes those.
A decoding sequence may carry drafts (1 + k tokens, one row), as many as the step's budget leaves
room for, never at anyone's preemption; each step carries the speculator's plan for the next
(engine/spec_decode/policy.py). A sequence that leaves (finished, aborted, preempted) leaves it too.

After the step, update_from_output() is the one way back; it returns what it did as data
(engine/core/step_update.py), and the output processor takes it from there.
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
from goodserve.engine.core.step_decision import StepDecision
from goodserve.engine.core.step_time_model import StepTimeModel
from goodserve.engine.core.step_update import StepUpdate, append_tokens, rejected_per_row
from goodserve.engine.seam.drafts import BranchOutput
from goodserve.engine.core.waiting_queue import WaitingQueue

if TYPE_CHECKING:  # the runner's output module imports torch; the scheduler needs none, nor the speculator
    from goodserve.engine.seam.runner_output import ModelRunnerOutput
    from goodserve.engine.spec_decode.policy import Speculator


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, speculator: Speculator | None = None,
                 step_time: StepTimeModel | None = None, eos_token_ids: list[int] | None = None) -> None:
        self.config = config
        self.eos_token_ids = eos_token_ids or []
        self.kv = kv
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}  # every unfinished sequence it was given, by id
        self.num_preemptions = 0
        self.step_time = step_time or StepTimeModel()  # the engine feeds it every step
        self.policy = make_policy(config, self.step_time)
        self.waiting = WaitingQueue(self.policy.waiting_key)
        self.speculator = speculator  # plans and proposes drafts (engine/spec_decode/policy.py); None: no speculation
        self.preempted: list[str] = []  # since the last step handed out: the runner's drafter drops them

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
            decision = self._schedule_now(StepDecision.micro_batch(busy, len(self.running) + len(self.waiting),
                                                                   self.config))
        else:
            decision = self._schedule_now()
        if decision is None:  # asked again once the step in flight is done: planned once
            self.policy.step_refused()
            return None
        out = decision.output(self.kv.tables)
        if out:
            out.preempted_seq_ids, self.preempted = self.preempted, []
        if self.speculator is not None:
            self.speculator.counted_step()
            out.num_next_drafts = self.speculator.plan_next(decision.seqs, out, len(self.running))
        return out

    def _schedule_now(self, decision: StepDecision | None = None) -> StepDecision:
        decision = decision or StepDecision()
        admits_any_step = self.policy.admits_any_step
        if not admits_any_step and self.policy.next_batch_ready(self.running, self.waiting):
            self._admit_whole_batch()
        if admits_any_step:
            for victim in displaced_running(self.policy, self.running, self.waiting, self.kv, decision.busy):
                self._requeue(victim)
        budget = self._schedule_running(decision, self.policy.running_budget())
        if admits_any_step and not decision.preempted and self.waiting:
            allowance = self.policy.admission_allowance(self.running, sum(decision.num_new))
            self._schedule_waiting(decision, min(budget, allowance))
        return decision

    def _schedule_ahead(self, in_flight: list[Sequence]) -> StepDecision | None:
        """One more decode token for each sequence of the step in flight that goes on (not finished,
        its token in flight not certainly its last), then the waiting sequences the policy admits
        now that sample on the device alone. Blocks allocated before a refusal are the ones the next
        step would allocate anyway: they stay in the block tables."""
        going_on = [seq for seq in in_flight if not seq.is_finished and not seq.ends_with_next_token()]
        if not going_on or (self.policy.admits_any_step
                            and displaced_running(self.policy, self.running, self.waiting, self.kv)):
            return None
        for seq in going_on:
            if not self.kv.allocate(seq, 1):
                return None
        decision = StepDecision(num_ahead=len(going_on))
        for seq in going_on:
            decision.add(seq, 1)
        if self.waiting and self.policy.admits_any_step:
            allowance = self.policy.admission_allowance(self.running, len(going_on))
            budget = min(self.config.max_num_batched_tokens - len(going_on), allowance)
            self._schedule_waiting(decision, max(budget, 0), lambda seq: seq.samples_on_device)
        return decision

    def _schedule_running(self, decision: StepDecision, budget: int) -> int:
        """Decodes first (the attention kernels take a batch's leading one-token rows apart), then
        unfinished prompts, in the policy's order."""
        ordered = sorted((seq for seq in self.running if seq.seq_id not in decision.busy), key=self.policy.running_key)
        for seq in ordered:
            if budget == 0 or decision.full:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_own = self.policy.granted(seq, min(seq.num_uncomputed_tokens, budget))
            if num_own == 0:
                continue
            drafts = self.speculator.drafts_for_step(seq, budget - num_own) if self.speculator else None
            num_drafts = len(drafts.token_ids) if drafts else 0
            num_new = num_own + num_drafts
            if drafts and not self.kv.allocate(seq, num_new):  # speculation never preempts anyone
                drafts, num_new = None, num_new - num_drafts
            while not self.kv.allocate(seq, num_new):
                victim = decision.first_victim(self.running, self.policy.victim_key)
                self._requeue(victim)
                decision.preempted = True
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                decision.add(seq, num_new, drafts)
                budget -= num_new
        return budget

    def _schedule_waiting(self, decision: StepDecision, budget: int, admissible=None) -> None:
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
        """The cached tokens an admitted sequence's prompt rows read besides its new ones, which the
        torch attention path (the CPU's) pays for: it attends one prompt row at a time over its whole
        context, so n copies of a cached prompt would cost one step n whole prompts' attention (8 x
        128 copies: 45 s). Counted against the budget, they enter over several bounded steps."""
        return seq.num_computed_tokens if self.config.attention_backend == "torch" else 0

    def _release_blocks(self, seq: Sequence, finished: bool = False) -> None:
        """A sequence that could not be admitted (or is preempted, or finished) gives back its blocks;
        the speculator lets it go (a draft model's blocks go with the next step's news)."""
        self.kv.free(seq, finished)
        if self.speculator is not None:
            self.speculator.release(seq)
        seq.num_computed_tokens = 0

    def _requeue(self, seq: Sequence) -> None:
        """Recompute preemption: free the blocks, requeue at the front; its tokens are kept."""
        self.running.remove(seq)
        self.policy.left(seq)
        self._release_blocks(seq)
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.preempted.append(seq.seq_id)
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
            self.advance(out, rejected_per_row(out, output), output.branches)
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
        num_rejected[row] last drafts of a speculating row, rolled back; the speculator hears how its
        drafts and side branches (branches[row]) went. Sequences that finished meanwhile (stopped or
        aborted while an async step ran) hold no blocks and are skipped."""
        self.policy.step_ran(out.num_tokens)
        for row, (seq_id, num_new) in enumerate(zip(out.seq_ids, out.num_new_tokens)):
            seq = self.seqs.get(seq_id)
            if seq is None:
                continue
            rejected = num_rejected.get(row, 0) if num_rejected else 0
            seq.num_computed_tokens += num_new - rejected
            if row in out.draft_token_ids or row in out.branches:
                self.speculator.verified(seq, out.draft_token_ids.get(row, []), rejected, out.branches.get(row),
                                         branches.get(row) if branches else None)
            if row in out.draft_token_ids:
                self.kv.free_tail(seq)
            self.kv.register_full_blocks(seq)

