"""A request as the engine tracks it: its sequences (n of them: the scheduler's state of each sample),
each sample's output state (text, logprobs: the output processor's) and its output view."""

from __future__ import annotations

from dataclasses import dataclass, field

from goodserve.engine.core.sequence import Sequence
from goodserve.model.detokenizer import IncrementalDetokenizer
from goodserve.outputs import CompletionOutput, LogprobsEntry, RequestOutput


@dataclass
class SampleOutput:
    """One sample as callers read it, written by the output processor (engine/frontend/output_processor.py)."""

    detokenizer: IncrementalDetokenizer | None = None
    text: str = ""
    logprobs: list[LogprobsEntry] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[LogprobsEntry | None] = field(default_factory=list)
    pooled: object | None = None  # pooling: the sum (a tensor) of the hidden states pooled so far
    embedding: list[float] | None = None  # pooling: the result, once the prompt is computed
    # what its outputs have handed over so far (SamplingParams.output_kind "delta")
    num_reported_tokens: int = 0
    num_reported_chars: int = 0


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    samples: list[SampleOutput] = field(default_factory=list)  # per sequence, by its index
    pending: list[Sequence] = field(default_factory=list)  # n > 1: not yet handed to the scheduler
    # Characters held back from a streamed text: a stop string may still complete there.
    holdback: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def output(self) -> RequestOutput:
        first, first_sample = self.seqs[0], self.samples[0]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[self._completion(seq) for seq in self.seqs],
            finished=self.finished,
            metrics=first.metrics,
            prompt_logprobs=first_sample.prompt_logprobs if first.wants_prompt_logprobs else None,
            num_cached_tokens=first.num_cached_tokens,
            error=self.error,
            embedding=first_sample.embedding,
        )

    def _completion(self, seq: Sequence) -> CompletionOutput:
        """seq's output: all of it, or (output_kind "delta") what it gained since its last output."""
        sample = self.samples[seq.index]
        text = sample.text
        if not seq.is_finished and self.holdback:
            text = text[: max(0, len(text) - self.holdback)]
        tokens_from, chars_from = 0, 0
        if seq.params.output_kind == "delta":
            tokens_from, chars_from = sample.num_reported_tokens, sample.num_reported_chars
            # (a stop string found later never cuts into text handed over: the holdback kept it back)
            sample.num_reported_tokens, sample.num_reported_chars = seq.num_output_tokens, max(len(text), chars_from)
        return CompletionOutput(
            index=seq.index,
            text=text[chars_from:],
            token_ids=seq.token_ids[seq.num_prompt_tokens + tokens_from:],  # a fresh list: the caller may keep it
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=sample.logprobs[tokens_from:] if seq.params.logprobs is not None else None,
            cumulative_logprob=sample.cumulative_logprob if seq.params.logprobs is not None else None,
        )
