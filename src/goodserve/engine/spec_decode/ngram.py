"""Prompt lookup ("inference with reference"): the tokens a sequence is about to write often already
stand in its prompt or output (a copied passage, an edited document, repeated code). Find the
latest earlier occurrence of its last n tokens (n from ngram_max down to ngram_min) and propose the
k tokens that followed it. Pure host work: no model, a vectorized scan of the token ids."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from goodserve.engine.seam.drafts import DraftRequest, Drafts


def propose_ngram(token_ids: list[int], ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix; []
    when no suffix of ngram_min or more tokens occurred before."""
    tokens = np.asarray(token_ids)
    for n in range(min(ngram_max, len(tokens) - 1), ngram_min - 1, -1):
        # Windows that end before the last token: the suffix itself is not an earlier occurrence.
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return token_ids[start : start + k]
    return []


class NgramProposer:
    """propose_ngram per sequence; it keeps nothing between steps."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, requests: list[DraftRequest]) -> list[Drafts]:
        return [Drafts(propose_ngram(r.token_ids, self.ngram_min, self.ngram_max, r.k)) for r in requests]

    def release(self, seq_id: str) -> None:
        pass
