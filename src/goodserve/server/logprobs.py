"""Engine logprobs (token id -> Logprob per position) in the two shapes OpenAI's APIs use."""

from __future__ import annotations

from collections.abc import Sequence

from goodserve.outputs import Logprob, LogprobsEntry
from goodserve.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


def _token_text(token_id: int, lp: Logprob) -> str:
    # The engine decodes each token alone (special tokens kept); a model without a tokenizer
    # gets vLLM's spelling for a bare id.
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{token_id}"


def _top(entry: LogprobsEntry, k: int) -> list[tuple[str, float]]:
    # The entry holds the top-k plus the sampled token; sort by value so rank's base never matters.
    ranked = sorted(entry.items(), key=lambda item: item[1].logprob, reverse=True)[:k]
    return [(_token_text(token_id, lp), lp.logprob) for token_id, lp in ranked]


def completion_logprobs(
    token_ids: Sequence[int], entries: Sequence[LogprobsEntry | None], k: int, text_offset: int,
    first_token: str | None = None,
) -> CompletionLogprobs:
    """entries: a None entry is an echoed prompt's first token (nothing predicts it), spelled first_token."""
    out = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries):
        token = first_token if entry is None else _token_text(token_id, entry[token_id])
        out.tokens.append(token)
        out.token_logprobs.append(None if entry is None else entry[token_id].logprob)
        out.top_logprobs.append(None if entry is None else dict(_top(entry, k)))
        out.text_offset.append(text_offset)
        text_offset += len(token)
    return out


def joined(first: CompletionLogprobs | None, second: CompletionLogprobs) -> CompletionLogprobs:
    """An echoed prompt's logprobs followed by the completion's."""
    if first is None:
        return second
    return CompletionLogprobs(**{name: getattr(first, name) + getattr(second, name)
                                 for name in CompletionLogprobs.model_fields})


def _top_logprob(token: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[LogprobsEntry], k: int) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries):
        sampled = _top_logprob(_token_text(token_id, entry[token_id]), entry[token_id].logprob)
        top = [_top_logprob(token, logprob) for token, logprob in _top(entry, k)]
        content.append(ChatTokenLogprob(**sampled.model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)
