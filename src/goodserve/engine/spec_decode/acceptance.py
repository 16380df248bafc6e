"""Verifying proposed tokens exactly: which of them the target model keeps.

A sequence with drafts d_0..d_{k-1} computes 1 + k query tokens in one step (its last token, then
the drafts), and the runner samples a token y_j at every position j, with the target's own settings
(temperature, top-k/p, penalties counting d_<j as output, min_tokens as of j more tokens, the seed's
next draws): y_j ~ p_j(. | prefix, d_<j). The sequence keeps y_0..y_a, where a is the first
position with y_a != d_a (or k: every draft kept, y_k is the bonus token).

Exact: each kept y_j was drawn from the target's distribution given the tokens before it (up to a,
those before it are the drafts, equal to the kept y's), so the kept tokens are what plain decoding
would have sampled, token by token. Greedy: y_j is the argmax, so the output is token-for-token that
of plain greedy decoding. Sampled: for a deterministic proposer (a point-mass draft q = [d]) this is
Leviathan et al.'s / Chen et al.'s rejection sampling: d is kept with probability p(d) = min(1,
p(d)/q(d)), and when it is not, y given y != d follows p with d removed, renormalized, which is their
residual max(0, p - q) normalized.
"""

from __future__ import annotations


def num_accepted(sampled: list[int], drafts: list[int]) -> int:
    """How many leading drafts the target's samples (one per position, 1 + len(drafts)) confirm."""
    for j, draft in enumerate(drafts):
        if sampled[j] != draft:
            return j
    return len(drafts)


def kept_tokens(sampled: list[int], drafts_per_row: list[list[int]]) -> list[list[int]]:
    """Per row, the tokens it keeps from its samples (1 + len(drafts) consecutive entries of sampled):
    the confirmed drafts, then the target's own token at the first mismatch (or the bonus token)."""
    if not any(drafts_per_row):  # a token a row
        return [[token] for token in sampled]
    kept, at = [], 0
    for drafts in drafts_per_row:
        row = sampled[at : at + 1 + len(drafts)]
        kept.append(row[: num_accepted(row, drafts) + 1])
        at += len(row)
    return kept
