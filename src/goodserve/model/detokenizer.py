"""Streaming detokenization that never emits half a character.

A byte-level BPE token can hold part of a UTF-8 character (an emoji is often 2-4 tokens), and a
SentencePiece token's leading space depends on what precedes it. The tokenizers library's DecodeStream
handles both in Rust, one call a token: it decodes a short window of recent tokens twice and emits
the difference once it no longer ends in an incomplete character (as vLLM and TGI do). Primed with
the prompt's last tokens, it sees what the first generated token attaches to. At the end, flush()
emits whatever it still holds back, incomplete character included.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from goodserve.model.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Tokens of context a stream starts from, so the decoder sees what the new tokens attach to.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.all_ids: list[int] = list(prompt_token_ids)
        self.read_offset = len(self.all_ids)  # tokens before this are already emitted
        self.text = ""  # everything emitted so far
        self._stream = self._stream_after_prompt()

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append generated tokens; return the newly completed text (possibly "")."""
        delta = ""
        for token_id in token_ids:
            self.all_ids.append(token_id)
            chunk = self._step(token_id)
            if chunk is not None:
                delta += chunk
                self.read_offset = len(self.all_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: emit what is held back, incomplete character included."""
        if self.read_offset == len(self.all_ids):
            return ""
        start = max(self.read_offset - _CONTEXT_TOKENS, 0)
        emitted = self._decode(self.all_ids[start : self.read_offset])
        delta = self._decode(self.all_ids[start:])[len(emitted) :]
        self.read_offset = len(self.all_ids)
        self.text += delta
        return delta

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self.tokenizer.backend, token_id)
        except Exception:
            # DecodeStream refuses a window whose text does not extend its context's (a prompt that
            # ends mid-character; some decoders' cleanups): go on without context, as vLLM does.
            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            return self._stream.step(self.tokenizer.backend, self.all_ids[self.read_offset :])

    def _stream_after_prompt(self) -> DecodeStream:
        """Primed with the prompt's last tokens. A prompt of token ids may end mid-character: then
        the stream starts before that character and holds its first bytes as pending, so that it
        comes out whole once generated tokens complete it."""
        end = start = len(self.all_ids)
        while start > max(end - 4, 0) and self._decode(self._context(start)).endswith(REPLACEMENT_CHAR):
            start -= 1  # (a UTF-8 character has at most 4 bytes, so at most 3 tokens of it end a prompt)
        stream = DecodeStream(self._context(start), skip_special_tokens=self.skip_special_tokens)
        for token_id in self.all_ids[start:end]:
            stream.step(self.tokenizer.backend, token_id)
        return stream

    def _context(self, end: int) -> list[int]:
        return self.all_ids[max(end - _CONTEXT_TOKENS, 0) : end]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
