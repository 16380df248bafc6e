"""Engine logprobs (token id -> Logprob per position) in the two shapes OpenAI's APIs use."""

from __future__ import annotations

from collections.abc import Sequence

from goodserve.outputs import LogprobsEntry
from goodserve.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


class TokenTexts:
    """Each token's own text, as OpenAI shows it (decoded alone, special tokens kept)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def _top(entry: LogprobsEntry, k: int) -> list[tuple[int, float]]:
    # The entry holds the top-k plus the sampled token; sort by value so rank's base never matters.
    ranked = sorted(entry.items(), key=lambda item: item[1].logprob, reverse=True)
    return [(token_id, lp.logprob) for token_id, lp in ranked[:k]]


def completion_logprobs(
    texts: TokenTexts, token_ids: Sequence[int], entries: Sequence[LogprobsEntry], k: int, text_offset: int
) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries):
        token = texts(token_id)
        out.tokens.append(token)
        out.token_logprobs.append(entry[token_id].logprob)
        out.top_logprobs.append({texts(t): lp for t, lp in _top(entry, k)})
        out.text_offset.append(text_offset)
        text_offset += len(token)
    return out


def _top_logprob(texts: TokenTexts, token_id: int, logprob: float) -> TopLogprob:
    token = texts(token_id)
    return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))


def chat_logprobs(
    texts: TokenTexts, token_ids: Sequence[int], entries: Sequence[LogprobsEntry], k: int
) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries):
        sampled = _top_logprob(texts, token_id, entry[token_id].logprob)
        top = [_top_logprob(texts, t, lp) for t, lp in _top(entry, k)]
        content.append(ChatTokenLogprob(**sampled.model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)
