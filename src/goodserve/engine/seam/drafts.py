"""What speculation hands around, as plain data: a sequence's drafts, the side branch a step
computes beside them (lookahead's window) and what the runner learned from that branch. Lists and
ints only (a draft model's distributions, a tensor, stay in the worker that drew them: typed here,
never imported): the scheduler, the scheduler output and the runner output share these without
importing torch (tests/unit/test_layering.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class Branch:
    """Guessed tokens hung after a sequence's last token: computed in its step, never cached, seen by
    no other token (ops/tree_attention.py). A tree: each token sees its ancestors and the context."""

    token_ids: list[int]
    parents: list[int]  # each token's parent, an earlier index (-1: the sequence's last token)
    logit_rows: list[int]  # the tokens after which the runner returns the target's greedy token


@dataclass
class DraftRequest:
    """What a proposer reads of a sequence: plain data, so that a proposer needs neither the
    scheduler's Sequence nor its process, only the tokens (prompt and output so far)."""

    seq_id: str
    token_ids: list[int]  # the sequence's tokens, its last one not yet computed
    k: int  # drafts wanted, at most
    temperature: float = 0.0  # > 0: a draft model samples its drafts at it
    seed: int | None = None  # a seeded sequence's own seed (its request's seed plus its index)


@dataclass
class Drafts:
    token_ids: list[int]
    # [len(token_ids), vocab] float32 on the draft's device: the distribution each draft was drawn
    # from, for the Leviathan / Chen rejection rule (rejection.py); None when the drafts are a point
    # mass (ngram, or a draft model at temperature 0), which acceptance.py's rule verifies. Set by a
    # draft model only, in the worker, where they stay (engine/worker/drafter.py): the scheduler's
    # drafts have none.
    probs: torch.Tensor | None = None
    # Tokens to compute beside the drafts without keeping them (lookahead's window); may come with
    # no drafts at all.
    branch: Branch | None = None

    def first(self, k: int) -> Drafts:
        """The first k drafts, the branch kept."""
        if k >= len(self.token_ids):
            return self
        return Drafts(self.token_ids[:k], branch=self.branch)


@dataclass
class BranchOutput:
    """What a row with a side branch learned in its step."""

    tokens: list[int]  # the target's greedy token after each of the branch's logit rows
    samples: list[int]  # its samples at its last token and each draft (rejected ones' too)
