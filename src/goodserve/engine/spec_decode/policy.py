"""When to speculate, and how it went. Verifying k drafts costs about one decode step while the
batch is small (a decode step reads every weight once for however few tokens); in a large batch the
step is compute-bound and rejected drafts cost real work. So: no drafts while more than
spec_max_batch sequences run; per sequence, an exponential moving average of its acceptance rate
(kept / proposed), and no drafts while it is under spec_min_acceptance, except a probe every
PROBE_EVERY tokens so a sequence that starts copying later is noticed. Drafts never exceed what the
sequence may still write (max_tokens, the context window) or the step's token budget.

Not speculated: sequences with a grammar (its mask for position j would need the matcher advanced
through the drafts before j) and prefill-only ones. Everything else is exact under speculation
(engine/spec_decode/acceptance.py, rejection.py). The policy decides each sequence's k; the proposer
behind it (proposer.py) proposes for all of them in one call."""

from __future__ import annotations

from goodserve.config import EngineConfig
from goodserve.engine.runner_output import BranchOutput
from goodserve.engine.sequence import Sequence
from goodserve.engine.spec_decode.proposer import Branch, Drafts, Proposer

EMA_WEIGHT = 0.3  # of the newest step's acceptance rate
PROBE_EVERY = 8


class Speculator:
    def __init__(self, config: EngineConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        # Counted as vLLM counts them (served under its metric names, server/metrics.py).
        self.num_drafts = 0  # verifications: one sequence's proposals checked in one step
        self.num_draft_tokens = 0  # proposed and verified
        self.num_accepted_tokens = 0  # of those, kept
        self.num_accepted_per_pos = [0] * config.num_speculative_tokens  # [j]: verifications that kept draft j

    def may_draft(self, num_running: int) -> bool:
        """Whether a step of num_running sequences speculates at all (the batch bound)."""
        return num_running <= self.config.spec_max_batch

    def drafts_wanted(self, seq: Sequence, num_running: int, room: int) -> int:
        """How many drafts seq's next step (it decodes one token) may verify, at most `room`."""
        c = self.config
        if not self.may_draft(num_running) or seq.grammar is not None or seq.params.prefill_only:
            return 0
        if seq.spec_acceptance < c.spec_min_acceptance and seq.num_output_tokens % PROBE_EVERY:
            return 0
        # The step writes 1 + k tokens: all of them must be allowed.
        left = min((seq.params.max_tokens or seq.max_len) - seq.num_output_tokens, seq.max_len - seq.num_tokens)
        return max(min(c.num_speculative_tokens, room, left - 1), 0)

    def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[str, Drafts]:
        """Drafts per sequence id, for every (sequence, k) at once."""
        proposed = self.proposer.propose(wanted)
        return {seq.seq_id: drafts for (seq, _), drafts in zip(wanted, proposed)
                if drafts.token_ids or drafts.branch is not None}

    def learn(self, seq: Sequence, drafts: list[int], branch: Branch, output: BranchOutput) -> None:
        """A step's results for a sequence that computed a side branch (lookahead), for its proposer."""
        self.proposer.learn(seq, drafts, branch, output)

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)

    def observe(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):  # kept drafts are a prefix: positions 0..num_accepted-1
            self.num_accepted_per_pos[position] += 1
        seq.spec_acceptance += EMA_WEIGHT * (num_accepted / num_proposed - seq.spec_acceptance)
