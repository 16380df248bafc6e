"""Streaming detokenization that never emits half a character.

A byte-level BPE token can hold part of a UTF-8 character (an emoji is often 2-4 tokens), and a
SentencePiece token's leading space depends on what precedes it. So each step decodes a short window
of recent tokens twice -- up to the last emitted token, and up to the newest -- and emits the
difference, holding it back while it ends in U+FFFD (an incomplete character). vLLM does the same.
"""

from __future__ import annotations

from collections.abc import Sequence

from goodserve.model.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Tokens of context before the window, so the decoder sees what the new tokens attach to.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.all_ids: list[int] = list(prompt_token_ids)
        self.prefix_offset = max(len(self.all_ids) - _CONTEXT_TOKENS, 0)  # window start
        self.read_offset = len(self.all_ids)  # tokens before this are already emitted
        self.text = ""  # everything emitted so far

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append generated tokens; return the newly completed text (possibly "")."""
        self.all_ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of a request: emit what is held back, incomplete character included."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.read_offset == len(self.all_ids):
            return ""
        prefix_text = self._decode(self.all_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.all_ids[self.prefix_offset :])
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR)):
            return ""  # no visible progress yet, or a character is still incomplete
        delta = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.all_ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
