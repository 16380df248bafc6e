"""Turns the tokens a step appended into what callers read: detokenizes them, checks stop strings
and the grammar's end, builds logprobs entries, records token times. The scheduler has already
appended the tokens and ended the sequences at a stop token or their length
(Scheduler.update_from_output); this module returns its own finishes (a stop string, a grammar's
end, which may come before the scheduler's) and its failures as data, for the engine to apply.

Text is detokenized as tokens arrive only where it is read before the end: when streaming
(stream_text) or to find stop strings. Otherwise it is detokenized once, at the finish, which costs
one tokenizer call per request instead of two per token.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from goodserve.engine.frontend.grammar import accept_token
from goodserve.engine.frontend.request import Request, SampleOutput
from goodserve.engine.seam.runner_output import ModelRunnerOutput
from goodserve.engine.seam.scheduler_output import SchedulerOutput
from goodserve.engine.core.sequence import Sequence
from goodserve.engine.core.step_update import Finish, StepUpdate
from goodserve.outputs import Logprob, LogprobsEntry, RequestOutput
from goodserve.sampling_params import SamplingParams

logger = logging.getLogger("goodserve.engine")


@dataclass
class ProcessedStep:
    """What the output processor found in a step, for the engine to apply."""

    # sequences that end here, or that the scheduler ended and end otherwise: at a stop string or a
    # grammar's end (their tokens after it dropped)
    finished: list[tuple[Sequence, Finish]] = field(default_factory=list)
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)  # their bookkeeping raised


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def process(self, requests: dict[str, Request], out: SchedulerOutput, seqs: list[Sequence],
                update: StepUpdate, output: ModelRunnerOutput, stream_text: bool) -> ProcessedStep:
        """A computed step's outputs for its rows' sequences (seqs), after the scheduler's update. An
        error in one sequence's bookkeeping fails its request (reported), never the step."""
        result, failed_requests = ProcessedStep(), set()

        def guarded(seq: Sequence, record, *args) -> None:
            request = requests.get(seq.request_id)
            if request is None or seq.request_id in failed_requests:  # aborted, or a sibling failed it
                return
            try:
                ended = record(request, seq, *args)
            except Exception as exc:
                logger.exception("recording the output of request %s failed", seq.request_id)
                failed_requests.add(seq.request_id)
                result.failed.append((seq, exc))
            else:
                if ended is not None:
                    result.finished.append((seq, ended))

        for row, entries in output.prompt_logprobs.items():
            guarded(seqs[row], self._store_prompt_logprobs, *entries)
        for row, total in output.pooled.items():  # a recomputed prompt (after a preemption) starts over
            request = requests.get(seqs[row].request_id)
            if request is not None:
                sample = request.samples[seqs[row].index]
                sample.pooled = total if out.num_computed_tokens[row] == 0 or sample.pooled is None \
                    else sample.pooled + total
        for seq in update.finished:
            if seq.params.prefill_only:
                guarded(seq, self._finish_prefill_only)
        for i, seq, count in update.appended:
            guarded(seq, self._record_tokens, count, output.logprobs.get(i), stream_text)
        return result

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

    def _record_tokens(self, request: Request, seq: Sequence, count: int, logprobs: list | None,
                       stream_text: bool) -> Finish | None:
        """The count tokens the scheduler appended to seq (logprobs: the runner's values, ids and rank
        per token), one by one; how seq ends at one of them, if this module ends it there."""
        now, first, sample = time.time(), seq.num_tokens - count, request.samples[seq.index]
        metrics = seq.metrics
        for j in range(count):
            metrics.token_times.append(now)
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
            if logprobs is not None:
                entry = self.logprobs_entry(*logprobs[j])
                sample.logprobs.append(entry)
                sample.cumulative_logprob += entry[seq.token_ids[first + j]].logprob
            finish = self._end_at(sample, seq, first + j, stream_text)
            if finish is not None:
                del seq.token_ids[first + j + 1 :]  # what a stop string or a grammar ends, ends here
                return finish
        return None

    def _end_at(self, sample: SampleOutput, seq: Sequence, pos: int, stream_text: bool) -> Finish | None:
        """Whether seq ends at its token `pos`: at the scheduler's stop token or a grammar's end (the
        stop token itself is not part of the text), or at a stop string; its text at the scheduler's
        length limit, all of it."""
        token, params = seq.token_ids[pos], seq.params
        last = pos == seq.num_tokens - 1
        # A grammar ends where it accepts its stop token (it allows one only once its text is complete).
        grammar_done = seq.grammar is not None and accept_token(seq, token)
        if grammar_done or (last and seq.finish_reason == "stop"):
            finish_text(sample, seq.token_ids, pos)
            return Finish("stop", token if token in params.stop_token_ids else None)
        if sample.detokenizer is not None and (stream_text or params.stop):
            delta = _detokenize_pending(sample, seq.token_ids, pos + 1)
            if params.stop and pos + 1 - seq.num_prompt_tokens >= params.min_tokens:
                stop = _truncate_at_stop_string(sample, params, len(delta))
                if stop is not None:
                    return Finish("stop", stop)
        if last and seq.is_finished:  # at its length
            finish_text(sample, seq.token_ids)
        return None

    def _finish_prefill_only(self, request: Request, seq: Sequence) -> None:
        """The scheduler ended it with its prompt computed: its embedding, its text."""
        sample = request.samples[seq.index]
        if seq.params.pooling is not None:  # the mean's direction is the sum's: normalizing drops the count
            sample.embedding = torch.nn.functional.normalize(sample.pooled, dim=0).tolist()
        finish_text(sample, seq.token_ids)

    def _store_prompt_logprobs(self, request: Request, seq: Sequence, first: int, values: list, ids: list,
                               ranks: list) -> None:
        """Entries from token `first` on; a recomputed prompt (after a preemption) replaces its own."""
        entries = request.samples[seq.index].prompt_logprobs
        del entries[first:]
        entries.extend(self.logprobs_entry(v, i, r) for v, i, r in zip(values, ids, ranks))

    def logprobs_entry(self, values: list[float], ids: list[int], rank: int) -> LogprobsEntry:
        """values/ids: the chosen token first, then the top alternatives (which may include it)."""
        entry: LogprobsEntry = {}
        for position, (token, value) in enumerate(zip(ids, values)):
            if token not in entry:
                decoded = self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else None
                entry[token] = Logprob(value, rank if position == 0 else position, decoded)
        return entry


def finish_text(sample: SampleOutput, token_ids: list[int], upto: int | None = None) -> None:
    """The text of token_ids (up to index upto), all of it: the last characters a detokenizer holds
    back included."""
    if sample.detokenizer is not None:
        _detokenize_pending(sample, token_ids, upto)
        sample.text += sample.detokenizer.flush()


def catch_up_text(sample: SampleOutput, token_ids: list[int]) -> None:
    """An aborted sample's text: every token it has, as far as the detokenizer can tell yet."""
    if sample.detokenizer is not None:
        _detokenize_pending(sample, token_ids)


def _detokenize_pending(sample: SampleOutput, token_ids: list[int], upto: int | None = None) -> str:
    """Feed the detokenizer the tokens of token_ids it has not seen (up to index upto); returns the
    new text."""
    delta = sample.detokenizer.add_tokens(token_ids[len(sample.detokenizer.all_ids) : upto])
    sample.text += delta
    return delta


def _truncate_at_stop_string(sample: SampleOutput, params: SamplingParams, new_chars: int) -> str | None:
    """The stop string the new text completed, if any (the sample's text then ends there)."""
    text = sample.text
    for stop in params.stop:  # only where the new text could complete a stop string
        at = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if at >= 0:
            sample.text = text[: at + (len(stop) if params.include_stop_str_in_output else 0)]
            return stop
    return None
