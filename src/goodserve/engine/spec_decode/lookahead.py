"""Lookahead (Jacobi) decoding (Fu et al., "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding", 2024): no draft model; each step computes, beside the sequence's last token and
its drafts, a window of guessed tokens whose outputs are a Jacobi iteration, and the n-grams those
iterations settle on feed a pool the drafts come from.

The window is L <= N - 1 levels of W tokens. Column i's tokens stand at consecutive positions after
the sequence's last token x_0: level 0 at depth i + 1, level m at depth i + 1 + m; each token sees the
context, x_0, level 0 up to its column, and its own column below it (one chain of guesses: a tree,
engine/seam/drafts.Branch, computed and never cached, ops/tree_attention.py). The target's
greedy token after each token of the last level is the next iterate: it becomes the new last level,
the oldest level drops, and each column with the one before it, (level0[i-1], level0[i], ...,
level_{L-1}[i], output[i]), is an n-gram the pool learns (a prediction after each pair and each
token). The verify window's own samples go in too (a prediction after each of its positions).

Drafts: prompt lookup of LOOKUP_MIN tokens or more first (a copied passage beats any guess), else a
chain of the pool's predictions from the sequence's last tokens. The verifier keeps only what the
target confirms (acceptance.py; rejection.py's rule for point masses at temperature > 0), so the
output is exactly speculation-off's. Not Fu et al.'s G parallel candidates: one draft chain, through
the runner's ordinary verify path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from goodserve.config import EngineConfig
from goodserve.engine.spec_decode.ngram import propose_ngram
from goodserve.engine.seam.drafts import Branch, BranchOutput, DraftRequest, Drafts

KEY_LENGTHS = (2, 1)  # the pool's keys: the last two tokens, else the last one
LOOKUP_MIN = 2  # prompt lookup's shortest match here: one token matches nearly anything


@dataclass
class _Window:
    levels: list[list[int]]  # oldest first, W tokens each
    pool: dict[tuple[int, ...], int] = field(default_factory=dict)  # key -> the token predicted after it


def window_branch(levels: list[list[int]]) -> Branch:
    """The window as a tree: level 0 a chain from x_0, level m at column i under level m - 1's;
    logits after the last level's tokens."""
    width = len(levels[0])
    parents = [i - 1 for i in range(width)]
    for m in range(1, len(levels)):
        parents += [(m - 1) * width + i for i in range(width)]
    last = (len(levels) - 1) * width
    return Branch([t for level in levels for t in level], parents, list(range(last, last + width)))


def learn_ngram(pool: dict[tuple[int, ...], int], path: list[int]) -> None:
    """Each token of path after its first two, predicted after the one or two tokens before it."""
    for j in range(2, len(path)):
        for n in KEY_LENGTHS:
            pool[tuple(path[j - n : j])] = path[j]


def propose_from_pool(pool: dict[tuple[int, ...], int], token_ids: list[int], k: int) -> list[int]:
    """Up to k tokens, each the pool's prediction after the tokens before it (the sequence's, then
    those proposed so far); [] when the pool knows nothing after the sequence's last tokens."""
    context, drafts = token_ids[-max(KEY_LENGTHS):], []
    while len(drafts) < k:
        tail = context + drafts
        token = next((pool[key] for n in KEY_LENGTHS if (key := tuple(tail[-n:])) in pool), None)
        if token is None:
            break
        drafts.append(token)
    return drafts


class LookaheadProposer:
    def __init__(self, config: EngineConfig) -> None:
        self.width, self.num_levels = config.lookahead_window, config.lookahead_ngram - 1
        self.ngram_max = config.ngram_max
        self.lookup_min = max(config.ngram_min, LOOKUP_MIN)
        self.windows: dict[str, _Window] = {}

    def propose(self, requests: list[DraftRequest]) -> list[Drafts]:
        return [self._propose(r.seq_id, r.token_ids, r.k) for r in requests]

    def _propose(self, seq_id: str, token_ids: list[int], k: int) -> Drafts:
        window = self.windows.get(seq_id)
        if window is None:  # Jacobi starts anywhere: the sequence's last tokens as the first guesses
            window = self.windows[seq_id] = _Window([_first_guesses(token_ids, self.width)])
        drafts = propose_ngram(token_ids, self.lookup_min, max(self.ngram_max, self.lookup_min), k) \
            or propose_from_pool(window.pool, token_ids, k)
        return Drafts(drafts, branch=window_branch(window.levels))

    def learn(self, seq_id: str, token_ids: list[int], drafts: list[int], branch: Branch,
              output: BranchOutput) -> None:
        """The step's outputs: the pool learns each column's n-gram and the verify window's samples,
        the window moves one Jacobi iteration on. token_ids end at the step's last own token."""
        window = self.windows.get(seq_id)
        if window is None:
            return
        levels, last = window.levels, token_ids[-1]
        for i, predicted in enumerate(output.tokens):
            before = levels[0][i - 1] if i else last
            learn_ngram(window.pool, [before, *(level[i] for level in levels), predicted])
        learn_verified(window.pool, token_ids[-2:], drafts, output.samples)
        window.levels = [*levels[len(levels) == self.num_levels:], list(output.tokens)]

    def release(self, seq_id: str) -> None:
        self.windows.pop(seq_id, None)


def learn_verified(pool: dict[tuple[int, ...], int], last: list[int], drafts: list[int], samples: list[int]) -> None:
    """samples[j]: the target's token after last[-1] and drafts[:j], rejected drafts or not."""
    context = [*last, *drafts]
    for j, token in enumerate(samples):
        learn_ngram(pool, [*context[: len(last) + j], token][-3:])


def _first_guesses(token_ids: list[int], width: int) -> list[int]:
    return [token_ids[max(len(token_ids) - width + i, 0)] for i in range(width)]
