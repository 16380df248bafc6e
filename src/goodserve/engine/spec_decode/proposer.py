"""One interface for every proposer: given the decoding sequences that speculate next step and how
many tokens each may take (the policy's k), propose up to that many each, in one call for the whole
batch (a draft model runs them all in one forward per draft position). Proposals are made after a
step, for the next one; the verifier (acceptance.py, rejection.py) never needs to know who proposed.
A proposer reads plain data (drafts.DraftRequest), never the scheduler's sequences, so it runs
wherever the tokens are known.

On the host, beside the scheduler (make_proposer; the speculator asks them, policy.py):
- ngram.py: prompt lookup, pure host work; its drafts are deterministic (a point mass).
- lookahead.py: lookahead (Jacobi) decoding: drafts from an n-gram pool that a window of parallel
  guesses fills, computed in the same step as a side branch (drafts.Branch) whose outputs come back
  through `learn`.
In the worker (engine/worker/drafter.py asks it, after the runner samples):
- draft_model.py: a draft model (another model with the target's vocabulary, or the target's own
  weights quantized: self:int4 / self:gguf) with a paged KV cache of its own; at temperature > 0 it
  samples its drafts and hands over the distributions it drew them from.
"""

from __future__ import annotations

from typing import Protocol

from goodserve.config import EngineConfig
from goodserve.engine.seam.drafts import DraftRequest, Drafts


class Proposer(Protocol):
    def propose(self, requests: list[DraftRequest]) -> list[Drafts]:
        """Per request: up to k tokens to follow its tokens (its last one not yet computed)."""

    def release(self, seq_id: str) -> None:
        """The sequence finished, was aborted or preempted: drop what the proposer keeps for it."""

    # A proposer whose Drafts carry a branch also has learn(seq_id, token_ids, drafts, branch, output):
    # the step's results for that sequence (drafts.BranchOutput), before its kept tokens are appended.


def make_proposer(config: EngineConfig) -> Proposer | None:
    """The host proposer the (resolved) config names; None when speculation is off or a draft model
    proposes (in the worker)."""
    if config.speculative_method == "ngram":
        from goodserve.engine.spec_decode.ngram import NgramProposer

        return NgramProposer(config.ngram_min, config.ngram_max)
    if config.speculative_method == "lookahead":
        from goodserve.engine.spec_decode.lookahead import LookaheadProposer

        return LookaheadProposer(config)
    return None
