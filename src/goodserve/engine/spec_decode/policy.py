"""When to speculate, and how it went. Decided per step, from the batch and each sequence's measured
acceptance, against what a verify step costs beside a plain decode step (VerifyCost):

- A sequence's acceptance is a moving average over its drafts' outcomes, one per draft judged (kept,
  or the first rejected), and a miss for each step the plan gave it drafts the proposer could not
  find (an n-gram with no match), so it estimates the chance a planned draft is kept; k drafts then
  add a + a^2 + ... + a^k tokens in expectation (kept drafts are a prefix). Counting the misses keeps
  a sequence whose text is never copied from staying in the plan on its starting estimate, which
  would keep every step synchronous (the step after one with a plan cannot run ahead of it:
  engine/frontend/engine.py).
- For each k, the sequences whose expected gain pays their own drafts' cost draft k; the step drafts
  with the k of the best throughput (tokens per step time over a plain step's), if that beats 1. A
  drafting sequence's cost counts lookahead's window too (tokens computed beside the drafts); a
  draft model's forwards (one per draft position, for the whole batch) count once per step.
- A sequence left out keeps its estimate, so it is re-measured by a probe: at most one step in
  PROBE_EVERY gives every eligible sequence left out k drafts, so a sequence that starts copying
  later is noticed. Where a probe step costs more than two plain steps (lookahead's, off the CPU's
  native decode stack), probes come that much less often, so they never take more than about
  1 / PROBE_EVERY of a run's time: on the CPU's gguf path lookahead lost 10% to its probes alone.
  No wall-clock time enters the decision (CPU timing noise would switch drafting on and off
  mid-run); the costs are a fixed table.
- No drafts at all while more than spec_max_batch sequences run (the cost table was measured up to
  batch 32); spec_policy "always" drafts num_speculative_tokens for every eligible sequence under
  that bound (tests, and benchmarks of the verify path).

The plan is made with the step it follows (plan_next: a k per row of the step that samples, in
SchedulerOutput.num_next_drafts) and proposed for once that step is computed (propose_next): by the
drafter in the runner (a draft model, engine/worker/drafter.py), whose drafts come back in the
step's output (ModelRunnerOutput.spec_token_ids), or by the host proposer behind it (proposer.py:
n-gram, lookahead), for all of them in one call. The host's drafts follow the plan made again then,
from acceptance that counts the step's own judged drafts: the plan made with a step only makes the
next one wait for its tokens, and holds every row that verifies drafts, whose outcome decides.
Drafts never exceed what the sequence may still write (max_tokens, the context window) or the step's
token budget. Not speculated: sequences with a grammar (its mask for position j would need the
matcher advanced through the drafts before j) and prefill-only ones. Everything else is exact under
speculation (engine/spec_decode/acceptance.py, rejection.py)."""

from __future__ import annotations

from dataclasses import dataclass

from goodserve.config import EngineConfig
from goodserve.engine.core.sequence import Sequence
from goodserve.engine.seam.drafts import Branch, BranchOutput, DraftRequest, Drafts
from goodserve.engine.seam.runner_output import ModelRunnerOutput
from goodserve.engine.seam.scheduler_output import SchedulerOutput
from goodserve.engine.spec_decode.proposer import Proposer

TRIAL_WEIGHT = 0.3  # of each judged draft in a sequence's acceptance average
PROBE_EVERY = 32  # steps: at most one in this many probes the sequences left out


@dataclass(frozen=True)
class VerifyCost:
    """Step times in units of a one-sequence decode step: a decode step of B sequences costs
    1 + per_seq * (B - 1); verifying D draft tokens among them adds fixed + per_draft_token * D."""

    per_seq: float
    fixed: float
    per_draft_token: float

    def ratio(self, num_seqs: int, num_draft_tokens: int) -> float:
        """A verify step's time over a plain decode step's, same sequences."""
        decode = 1 + self.per_seq * (num_seqs - 1)
        return (decode + self.fixed + self.per_draft_token * num_draft_tokens) / decode


# Verify steps replay the mixed-step CUDA graphs. H100, dummy llama-3.1-8b bf16, 512 cached tokens
# a sequence (benchmarks/results/gpu_spec_decode_ebe1590_h100.json, `verify`): a decode graph takes
# 6.21 / 6.65 / 7.45 ms at batch 1 / 8 / 32; the same 1 + k tokens a sequence through a mixed graph
# 1.15x that at batch 1 (any k <= 8), 1.09-1.18x at batch 8 and 1.14-1.51x at batch 32 (k = 1..8).
# This form gives 1.15-1.17, 1.16-1.22 and 1.17-1.55: a little dearer than measured.
GRAPHED_COST = VerifyCost(per_seq=0.0064, fixed=0.15, per_draft_token=0.002)
# Eager steps (the CPU): each token adds ~0.056 of a one-token step; the embedded model, float32,
# two threads, 300-token context: 1 / 5 / 9 / 13 / 17 tokens in 33.5 / 40.2 / 47.8 / 55.4 / 63.4 ms
# (benchmarks/BENCHMARKS.md, lookahead decoding).
EAGER_COST = VerifyCost(per_seq=0.056, fixed=0.0, per_draft_token=0.056)


# The CPU's native decode stack (model/native_decode.py: a GGUF or int4 model's decode step in one
# native call) runs decode rows only. Lookahead's steps (tree attention over the window) take the
# per-op path, so they cost several decode steps: The embedded model in gguf, two threads, 300 cached tokens, two runs: decode 11.1-11.6 /
# 20.4-23.9 ms at batch 1 / 4; verify k = 1 / 2 / 4 21.2-25.9 / 22.4-28.3 / 29.2-35.0 ms at batch 1 and
# 50.5-73.5 / 63.0-84.7 / 81.3-107.4 at batch 4 (benchmarks/results/cpu_spec_decode_verify{,_run1}.json).
# Least squares on the relative error over both runs' 16 cells: batch 1 within 2.0-3.1 decode steps of
# the measured 1.9-3.0, batch 4 4.2-8.5 against 4.5-9.2. EAGER_COST above still holds for the float32
# model in the same runs (verify k = 4 at batch 1 1.02-1.07x a decode step).
NATIVE_DECODE_COST = VerifyCost(per_seq=0.37, fixed=0.61, per_draft_token=0.36)
# Other verify steps go as one-token rows (model_inputs.as_one_token_rows) through the native stack: a
# decode step of B + D rows. Same model, threads and context, two runs: decode 11.1-11.6 / 18.4-20.6
# ms at batch 1 / 4; verify k = 1 / 2 / 4 11.7-12.4 / 14.1-15.0 / 22.8-24.6 ms at batch 1 and
# 30.4-36.3 / 42.5-47.9 / 68.0-71.8 at batch 4 (benchmarks/results/cpu_spec_decode_verify_split{,_run2}.json).
# Least squares on the relative error over both runs' 12 cells: within 10% of each (1.06-1.99 decode
# steps at batch 1 against the measured 1.06-2.13). The fixed term is negative: a step's rows go
# through each weight tile in passes of up to 4, so a draft or two ride in the first pass nearly free.
NATIVE_SPLIT_COST = VerifyCost(per_seq=0.24, fixed=-0.25, per_draft_token=0.31)


# A draft model's step (draft_model.py), eager: ~1/4 of a float32 target step for the embedded
# model's self:int4 draft on the CPU (benchmarks/BENCHMARKS.md, CPU speculative decoding). Not
# measured on a GPU, where the draft runs eagerly after graphed target steps: likely dearer there.
DRAFT_POSITION_COST = 0.25


def verify_cost(config: EngineConfig, native_decode: bool = False) -> VerifyCost:
    """The table of the path a verify step takes: a CUDA graph where graphs run (model_runner.py);
    native_decode: the decode steps it is weighed against run the CPU's native stack."""
    if native_decode:
        return NATIVE_DECODE_COST if config.speculative_method == "lookahead" else NATIVE_SPLIT_COST
    graphed = config.device.startswith("cuda") and not config.enforce_eager \
        and config.attention_backend == "triton" and config.pipeline_parallel_size == 1
    return GRAPHED_COST if graphed else EAGER_COST


class Speculator:
    def __init__(self, config: EngineConfig, proposer: Proposer | None, cost: VerifyCost | None = None) -> None:
        """proposer: the host's (n-gram, lookahead); None where the runner's drafter proposes (a draft model)."""
        self.config = config
        self.proposer = proposer
        self.cost = cost or verify_cost(config)
        # tokens a drafting sequence computes beside its drafts: lookahead's window (lookahead.py)
        self.branch_tokens = config.lookahead_window * (config.lookahead_ngram - 1) \
            if config.speculative_method == "lookahead" else 0
        # a draft model's forward per draft position, for the whole batch, in one-sequence decode steps
        self.draft_position_cost = DRAFT_POSITION_COST if config.speculative_method == "draft" else 0.0
        # a probe step's cost beyond a plain step's, in plain steps (one sequence, k drafts and any window)
        k = config.num_speculative_tokens
        probe_extra = self.cost.ratio(1, k + self.branch_tokens) - 1 + self.draft_position_cost * k
        self.probe_every = max(PROBE_EVERY, round(PROBE_EVERY * probe_extra))
        self.steps_since_probe = 0
        self.pending: dict[str, Drafts] = {}  # proposed after a step for the next, by sequence id
        self.probed: set[str] = set()  # sequences a probe planned, until their drafts are proposed
        # Counted as vLLM counts them (served under its metric names, server/metrics.py).
        self.num_drafts = 0  # verifications: one sequence's proposals checked in one step
        self.num_draft_tokens = 0  # proposed and verified
        self.num_accepted_tokens = 0  # of those, kept
        self.num_accepted_per_pos = [0] * config.num_speculative_tokens  # [j]: verifications that kept draft j

    def plan(self, seqs: list[Sequence], num_running: int) -> dict[str, int]:
        """k per sequence id (of seqs, the decoding ones) for the next step; absent: no drafts."""
        c = self.config
        eligible = [seq for seq in seqs if seq.grammar is None and not seq.params.prefill_only] \
            if num_running <= c.spec_max_batch else []
        if c.spec_policy == "always":
            return dict.fromkeys((seq.seq_id for seq in eligible), c.num_speculative_tokens)
        plan = self._paying(eligible, num_running)
        if self.probe_due:
            plan |= {seq.seq_id: c.num_speculative_tokens for seq in eligible if seq.seq_id not in plan}
        return plan

    def _paying(self, seqs: list[Sequence], num_running: int) -> dict[str, int]:
        """The k of the best expected throughput, for the sequences whose gain pays their drafts."""
        best, best_gain = {}, 1.0
        decode = 1 + self.cost.per_seq * (num_running - 1)
        acceptance = [seq.spec_acceptance for seq in seqs]
        powers, gains = [1.0] * len(seqs), [0.0] * len(seqs)  # per sequence, a^k and a + ... + a^k
        for k in range(1, self.config.num_speculative_tokens + 1):
            powers = [p * a for p, a in zip(powers, acceptance)]
            gains = [g + p for g, p in zip(gains, powers)]
            # a sequence's k drafts (and window) cost per_draft_token each, of a step that gives
            # num_running tokens
            own_cost = num_running * self.cost.per_draft_token * (k + self.branch_tokens) / decode
            chosen = [i for i, gain in enumerate(gains) if gain > own_cost]
            if not chosen:
                continue
            tokens = num_running + sum(gains[i] for i in chosen)
            cost = self.cost.ratio(num_running, (k + self.branch_tokens) * len(chosen)) \
                + self.draft_position_cost * k / decode
            gain = tokens / num_running / cost
            if gain > best_gain:
                best, best_gain = {seqs[i].seq_id: k for i in chosen}, gain
        return best

    def plan_next(self, seqs: list[Sequence], out: SchedulerOutput, num_running: int) -> dict[int, int]:
        """With a step (seqs: its rows' sequences), the plan for the next one: row -> how many drafts
        to propose once this step is computed, for the rows that sample (they decode next), as many
        as the plan gives and the sequence may still write after this step's token. A plan made
        while a probe is due probes (it holds every eligible sequence), whatever is proposed then
        (an n-gram may find no match), so the probes' steps stay bounded: the step after each is
        synchronous."""
        sampling = [(row, seq) for row, seq in enumerate(seqs) if out.samples[row]]
        verifying = {seq.seq_id: self.config.num_speculative_tokens for row, seq in sampling
                     if row in out.draft_token_ids}
        if self.proposer is not None and verifying and not self.probe_due:
            # a host proposer plans again once the step's drafts are judged (propose_next): this plan
            # only makes the next step wait for them
            plan = verifying
        else:
            plan = self.plan([seq for _, seq in sampling], num_running)
            if self.proposer is not None:
                plan |= verifying
        found = {row: k for row, seq in sampling if (k := self.drafts_for(seq, plan.get(seq.seq_id, 0), written=1))}
        if found and self.probe_due:
            self.steps_since_probe = 0
            self.probed |= {seqs[row].seq_id for row in found}
        return found

    def propose_next(self, out: SchedulerOutput, output: ModelRunnerOutput, seqs: dict[str, Sequence],
                     num_running: int) -> None:
        """Once step `out` is computed and its tokens appended: the drafts for the next step, from the
        runner's drafter (output.spec_token_ids, for the rows the step planned) or, with a host
        proposer, proposed now, in one call, as many as each sequence may still write. The step's
        plan made it synchronous; a host proposer's drafts follow the plan made again now, from
        acceptance that counts this step's judged drafts (a sequence whose drafts were just rejected
        stops drafting at once), and for the step's rows a probe holds. The next step takes what its
        budget leaves room for (drafts_for_step). seqs: the unfinished sequences by id."""
        # a step without a plan may have the next one in flight already: nothing to propose after it
        rows = [(row, seq) for row, seq_id in enumerate(out.seq_ids)
                if out.num_next_drafts and out.samples[row] and (seq := seqs.get(seq_id)) is not None]
        if self.proposer is None:
            proposals = [(seq, Drafts(output.spec_token_ids.get(row, []))) for row, seq in rows
                         if row in out.num_next_drafts]
        else:
            plan = self.plan([seq for _, seq in rows], num_running)
            probed = {seq.seq_id: out.num_next_drafts[row] for row, seq in rows if seq.seq_id in self.probed}
            wanted = [(seq, left) for _, seq in rows
                      if (left := self.drafts_for(seq, probed.get(seq.seq_id) or plan.get(seq.seq_id, 0)))]
            proposals = zip((seq for seq, _ in wanted), self.propose(wanted))
        self.probed.difference_update(seq.seq_id for _, seq in rows)  # a step ahead may have probed others
        self.pending = {}
        for seq, drafts in proposals:
            if drafts.token_ids or drafts.branch is not None:
                self.pending[seq.seq_id] = drafts
            else:  # nothing to verify: a draft planned and not kept, or the plan never empties
                seq.spec_acceptance -= TRIAL_WEIGHT * seq.spec_acceptance

    def drafts_for_step(self, seq: Sequence, room: int) -> Drafts | None:
        """seq's proposed drafts, at most `room` of them (what the step's budget leaves after its own
        token) and what it may still write; None when there are none or no room."""
        drafts = self.pending.get(seq.seq_id)
        if drafts is None or room <= 0:
            return None
        drafts = drafts.first(min(room, self.drafts_for(seq, len(drafts.token_ids))))
        return drafts if drafts.token_ids or drafts.branch is not None else None

    def drafts_for(self, seq: Sequence, k: int, written: int = 0) -> int:
        """Of k drafts, those seq's step may verify once it has written `written` more tokens: the
        step writes 1 + k tokens, all of which must be allowed."""
        left = min((seq.params.max_tokens or seq.max_len) - seq.num_output_tokens, seq.max_len - seq.num_tokens)
        return max(min(k, left - written - 1), 0)

    @property
    def probe_due(self) -> bool:
        return self.steps_since_probe >= self.probe_every

    def counted_step(self) -> None:
        """A step was scheduled (ahead of the one in flight too)."""
        self.steps_since_probe += 1

    def propose(self, wanted: list[tuple[Sequence, int]]) -> list[Drafts]:
        """The host proposer's drafts for every (sequence, k) at once."""
        return self.proposer.propose([DraftRequest(seq.seq_id, seq.token_ids, k) for seq, k in wanted])

    def verified(self, seq: Sequence, drafts: list[int], num_rejected: int, branch: Branch | None = None,
                 output: BranchOutput | None = None) -> None:
        """A step verified seq's drafts and rejected the last num_rejected; a sequence that computed
        a side branch (lookahead) hands its results to the proposer, before its kept tokens are appended."""
        if drafts:
            self.observe(seq, len(drafts), len(drafts) - num_rejected)
        if output is not None:
            self.proposer.learn(seq.seq_id, seq.token_ids, drafts, branch, output)

    def release(self, seq: Sequence) -> None:
        """seq left (finished, aborted, preempted); the runner's drafter hears of it with the next
        step (SchedulerOutput.finished_seq_ids, preempted_seq_ids)."""
        self.pending.pop(seq.seq_id, None)
        self.probed.discard(seq.seq_id)
        if self.proposer is not None:
            self.proposer.release(seq.seq_id)

    def observe(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):  # kept drafts are a prefix: positions 0..num_accepted-1
            self.num_accepted_per_pos[position] += 1
        # the judged drafts: the kept ones, then the first rejected (the rest were never judged)
        for kept in [1.0] * num_accepted + [0.0] * (num_accepted < num_proposed):
            seq.spec_acceptance += TRIAL_WEIGHT * (kept - seq.spec_acceptance)
