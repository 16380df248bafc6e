"""Synthetic prompt text of a requested token length, and token counting, with or without a tokenizer.

With the model's tokenizer, text is decoded from random token ids and re-encoded to land on the
requested length (as vLLM's random dataset does). Without one (a remote model whose tokenizer is
not available here), text is made of common English words, each about one token in BPE
vocabularies, and counts are word counts: approximate, and labelled as such in the result.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

# Short, frequent words: one BPE token each in the Llama, GPT-2 and SmolLM vocabularies.
_WORDS = (
    "the of and to in is was for on are with as be at by this have from or had not but what all "
    "were when we there can an your which their said if do will each about how up out them then "
    "she many some so these would other into has more her two like him see time could no make "
    "than first been its who now people my made over did down only way find use may water long "
    "little very after words called just where most know get through back much go good new write "
    "our me man too any day same right look think also around another came come work three word "
    "must because does part even place well such here take why things help put years different"
).split()


class TextTokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class PromptText:
    """Makes text of n tokens and counts tokens in text."""

    def __init__(self, tokenizer: TextTokenizer | None, seed: int = 0):
        self.tokenizer = tokenizer
        self.rng = np.random.default_rng(seed)

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def make(self, num_tokens: int) -> str:
        if num_tokens <= 0:
            return ""
        if self.tokenizer is None:
            return " ".join(self.rng.choice(_WORDS, size=num_tokens))
        return self._make_with_tokenizer(num_tokens)

    def _make_with_tokenizer(self, num_tokens: int) -> str:
        tok = self.tokenizer
        # Skip the low ids, where vocabularies keep special and byte tokens.
        low = min(1000, tok.vocab_size // 4)
        ids = self.rng.integers(low, tok.vocab_size, size=num_tokens).tolist()
        # Decoding then re-encoding merges or splits tokens; trim and pad until the count holds.
        for _ in range(4):
            text = tok.decode(ids, skip_special_tokens=True)
            ids = tok.encode(text, add_special_tokens=False)
            if len(ids) >= num_tokens:
                ids = ids[:num_tokens]
            else:
                ids += self.rng.integers(low, tok.vocab_size, size=num_tokens - len(ids)).tolist()
        return tok.decode(ids, skip_special_tokens=True)
