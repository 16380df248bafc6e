"""Lookahead (Jacobi) decoding, a minimal version: an n-gram pool filled by the model's own verify
forwards. A verify step computes the target's token y_j at every position j of its window, given
the sequence and the window's tokens x_0..x_j before it (x_0 its last token, x_j = draft j-1). Past
a rejected draft those y_j are what a Jacobi iteration computes: the model's next token after a
guessed context, right wherever the guess's last tokens recur. Each (x_{j-1}, x_j) -> y_j, and
x_j -> y_j, goes into the sequence's pool; when prompt lookup finds nothing, the pool proposes by
chaining its entries from the sequence's last tokens. The verifier keeps only what the target
confirms, so the output is unchanged (engine/spec_decode/acceptance.py).

Not Fu et al.'s full method: no lookahead branch of parallel Jacobi guesses in the same forward
(its pool fills only from windows prompt lookup or the pool proposed), no 2D window.
"""

from __future__ import annotations

KEY_LENGTHS = (2, 1)  # tried longest first


def harvest(pool: dict[tuple[int, ...], int], before: int, window: list[int], predicted: list[int]) -> None:
    """Record what the target predicted after each position of a verify window: window = x_0..x_k
    (its last token, then the drafts), predicted = y_0..y_k, before = the token ahead of x_0."""
    context = [before, *window]
    for j, token in enumerate(predicted):
        for n in KEY_LENGTHS:
            pool[tuple(context[j + 2 - n : j + 2])] = token


def propose_from_pool(pool: dict[tuple[int, ...], int], token_ids: list[int], k: int) -> list[int]:
    """Up to k tokens, each the pool's prediction after the tokens before it (the sequence's, then
    the ones proposed so far); [] when the pool knows nothing after the sequence's last tokens."""
    tail, drafts = token_ids[-max(KEY_LENGTHS):], []
    while len(drafts) < k:
        context = tail + drafts
        token = next((pool[key] for n in KEY_LENGTHS if (key := tuple(context[-n:])) in pool), None)
        if token is None:
            break
        drafts.append(token)
    return drafts
