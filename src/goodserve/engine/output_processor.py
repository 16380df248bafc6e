"""Turns sampled tokens into what callers read: appends each token, checks the stop conditions,
detokenizes, builds logprobs entries. It decides that a sequence finishes (and why); the engine
takes it out of the scheduler.

Text is detokenized as tokens arrive only where it is read before the end: when streaming
(stream_text) or to find stop strings. Otherwise it is detokenized once, at the finish, which costs
one tokenizer call per request instead of two per token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from goodserve.engine.grammar import accept_token
from goodserve.engine.request import Request
from goodserve.engine.runner_output import ModelRunnerOutput
from goodserve.engine.scheduler_output import SchedulerOutput
from goodserve.engine.sequence import Sequence
from goodserve.model.detokenizer import IncrementalDetokenizer
from goodserve.outputs import Logprob, LogprobsEntry, RequestOutput

logger = logging.getLogger("goodserve.engine")


@dataclass
class Finish:
    reason: str  # "stop" | "length"
    stop_reason: int | str | None = None


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids

    def record_step(self, requests: dict[str, Request], out: SchedulerOutput, seqs: list[Sequence],
                    output: ModelRunnerOutput, stream_text: bool, finish: Callable[[Sequence, Finish], None],
                    fail: Callable[[str, Exception], None]) -> None:
        """A computed step's outputs, sequence by sequence. finish: takes a finished sequence out of
        the engine; fail: fails a request whose bookkeeping raised (never the step)."""

        def guarded(seq: Sequence, record, *args) -> None:
            try:
                ended = record(requests[seq.request_id], seq, *args)
            except Exception as exc:
                logger.exception("recording the output of request %s failed", seq.request_id)
                fail(seq.request_id, exc)
            else:
                if ended is not None:
                    finish(seq, ended)

        for row, entries in output.prompt_logprobs.items():
            guarded(seqs[row], self._store_prompt_logprobs, *entries)
        for row, total in output.pooled.items():  # a recomputed prompt (after a preemption) starts over
            seq = seqs[row]
            seq.pooled = total if out.num_computed_tokens[row] == 0 or seq.pooled is None else seq.pooled + total
        for seq in seqs:
            if seq.params.prefill_only and not seq.is_finished and seq.num_computed_tokens >= seq.num_prompt_tokens:
                guarded(seq, self._finish_prefill_only)
        for i, (row, tokens) in enumerate(zip(output.sample_rows, output.token_ids)):
            seq, logprobs = seqs[row], output.logprobs.get(i)
            for j, token in enumerate(tokens):
                if seq.is_finished:  # it stopped (at a token before, or a step before), or a sibling failed it
                    break
                guarded(seq, self._append_token, token, logprobs and logprobs[j], stream_text)

    @staticmethod
    def collect(requests: dict[str, Request], changed: set[str], finished_only: bool) -> list[RequestOutput]:
        """The outputs of the changed requests (only the finished ones, with finished_only); a
        finished request leaves `requests`."""
        outputs = []
        for request_id in changed:
            request = requests.get(request_id)
            if request is None or (finished_only and not request.finished):
                continue
            outputs.append(request.output())
            if request.finished:
                del requests[request_id]
        return outputs

    def _append_token(self, request: Request, seq: Sequence, token: int, logprobs: tuple | None,
                     stream_text: bool) -> Finish | None:
        """Record a sampled token (logprobs: the runner's values, ids and rank for it); how seq
        finishes with it, if it does."""
        now = time.time()
        seq.token_ids.append(token)
        metrics = seq.metrics
        metrics.token_times.append(now)
        metrics.first_token_time = metrics.first_token_time or now
        metrics.last_token_time = now
        if logprobs is not None:
            entry = self.logprobs_entry(*logprobs)
            seq.logprobs.append(entry)
            seq.cumulative_logprob += entry[token].logprob
        params = seq.params
        may_stop = seq.num_output_tokens >= params.min_tokens
        detokenizer = request.detokenizers[seq.index]
        # A grammar ends where it accepts its stop token (it allows one only once its text is complete).
        grammar_done = seq.grammar is not None and accept_token(seq, token)
        if grammar_done or may_stop and (
                token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos)):
            # the stop token itself is not part of the text
            self.finish_text(seq, detokenizer, text_tokens=seq.num_tokens - 1)
            return Finish("stop", token if token in params.stop_token_ids else None)
        if detokenizer is not None and (stream_text or params.stop):
            delta = _detokenize_pending(seq, detokenizer)
            if may_stop and params.stop:
                stop = _truncate_at_stop_string(seq, len(delta))
                if stop is not None:
                    return Finish("stop", stop)
        if seq.num_output_tokens >= (params.max_tokens or seq.max_len) or seq.num_tokens >= seq.max_len:
            self.finish_text(seq, detokenizer)
            return Finish("length")
        return None

    def _finish_prefill_only(self, request: Request, seq: Sequence) -> Finish:
        if seq.params.pooling is not None:  # the mean's direction is the sum's: normalizing drops the count
            seq.embedding = torch.nn.functional.normalize(seq.pooled, dim=0).tolist()
        self.finish_text(seq, request.detokenizers[seq.index])
        return Finish("length")

    def finish_text(self, seq: Sequence, detokenizer: IncrementalDetokenizer | None,
                    text_tokens: int | None = None) -> None:
        """The text of seq's tokens (up to token index text_tokens), all of it: the last characters a
        detokenizer holds back included."""
        if detokenizer is not None:
            _detokenize_pending(seq, detokenizer, text_tokens)
            seq.text += detokenizer.flush()

    def catch_up_text(self, request: Request, seq: Sequence) -> None:
        """An aborted sequence's text: every token it has, as far as the detokenizer can tell yet."""
        detokenizer = request.detokenizers[seq.index]
        if detokenizer is not None:
            _detokenize_pending(seq, detokenizer)

    def _store_prompt_logprobs(self, request: Request, seq: Sequence, first: int, values: list, ids: list,
                               ranks: list) -> None:
        """Entries from token `first` on; a recomputed prompt (after a preemption) replaces its own."""
        del seq.prompt_logprobs[first:]
        seq.prompt_logprobs.extend(self.logprobs_entry(v, i, r) for v, i, r in zip(values, ids, ranks))

    def logprobs_entry(self, values: list[float], ids: list[int], rank: int) -> LogprobsEntry:
        """values/ids: the chosen token first, then the top alternatives (which may include it)."""
        entry: LogprobsEntry = {}
        for position, (token, value) in enumerate(zip(ids, values)):
            if token not in entry:
                decoded = self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else None
                entry[token] = Logprob(value, rank if position == 0 else position, decoded)
        return entry


def _detokenize_pending(seq: Sequence, detokenizer: IncrementalDetokenizer, upto: int | None = None) -> str:
    """Feed the detokenizer the tokens it has not seen (up to token index `upto`); returns the new text."""
    delta = detokenizer.add_tokens(seq.token_ids[len(detokenizer.all_ids) : upto])
    seq.text += delta
    return delta


def _truncate_at_stop_string(seq: Sequence, new_chars: int) -> str | None:
    """The stop string the new text completed, if any (seq's text then ends there)."""
    for stop in seq.params.stop:  # only where the new text could complete a stop string
        at = seq.text.find(stop, max(0, len(seq.text) - new_chars - len(stop) + 1))
        if at >= 0:
            seq.text = seq.text[: at + (len(stop) if seq.params.include_stop_str_in_output else 0)]
            return stop
    return None
