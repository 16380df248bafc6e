"""One API call's trip through the engine: its prompts' requests, merged into choice deltas.

The engine hands each request's outputs over as deltas (SamplingParams.output_kind "delta": a step
copies only what it added); the job joins them into each prompt's output so far (`final`).

A job may end a choice early (ends_early: a required tool-call array that repeats a call): the choice
finishes there as "stop", and once none of a prompt's choices runs on, its engine request is
released (aborted) like a finished one.

Cancellation is the abort path: when the client goes away, the task serving it is cancelled, the
job releases its engine requests, and AsyncEngine aborts those not finished (their KV blocks are
freed at the engine's next step). A deadline does the same thing on a timer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TypeVar

from starlette.requests import Request

from goodserve.engine.frontend.admission import Admission
from goodserve.outputs import LogprobsEntry, RequestOutput
from goodserve.sampling_params import SamplingParams
from goodserve.server.errors import ClientDisconnectedError, ClientNotReadingError, DeadlineExceededError
from goodserve.server.metrics import ServerMetrics, Slo
from goodserve.server.protocol import PromptTokensDetails, Usage

T = TypeVar("T")
logger = logging.getLogger("goodserve.server")


@dataclass
class ChoiceDelta:
    """What one choice gained since the last delta."""

    index: int  # prompt_index * n + output index, as OpenAI numbers choices
    text: str
    token_ids: list[int]
    logprobs: list[LogprobsEntry] | None
    finish_reason: str | None
    stop_reason: int | str | None
    first: bool  # the choice's first delta (chat sends the role with it)
    text_offset: int  # characters of this choice's text sent before this delta


@dataclass
class _Sent:
    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False


@dataclass
class GenerationJob:
    engine: object  # AsyncEngine
    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    admission: Admission
    metrics: ServerMetrics
    deadline: float | None = None  # time.monotonic() by which the whole call must finish
    # per prompt: outputs produced but not yet taken by the response; None: never aborted for it
    max_unsent_outputs: int | None = 512
    stream_interval: int = 1  # deltas() yields a choice's first token alone, then every this many tokens
    # (a choice's text so far, what it just gained) -> whether the choice ends there; None: never early
    ends_early: Callable[[str, str], bool] | None = None
    final: dict[int, RequestOutput] = field(default_factory=dict)  # each prompt's output so far
    _sent: dict[int, _Sent] = field(default_factory=dict)
    _queued: set[int] = field(default_factory=set)  # prompts holding a place in the waiting queue
    _ended_early: dict[int, set[int]] = field(default_factory=dict)  # per prompt: its choices ended early

    def _engine_request_id(self, prompt_index: int) -> str:
        return self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{prompt_index}"

    def _arrived(self, queue: asyncio.Queue, index: int, item: RequestOutput | BaseException) -> None:
        """One engine request's output (or the exception that ended it), handed over on the event loop."""
        if (self.max_unsent_outputs is not None and queue.qsize() >= self.max_unsent_outputs * len(self.prompts)
                and isinstance(item, RequestOutput)):
            # The response is stuck sending (its client stopped reading): stop generating for it;
            # releasing the request aborts it and frees its KV blocks.
            logger.info("aborting %s: its client stopped reading (%d outputs unsent)", self.request_id, queue.qsize())
            self.engine.release(self._engine_request_id(index))
            item = ClientNotReadingError("the client stopped reading this stream; it was aborted")
        queue.put_nowait((index, item))

    def admit(self) -> None:
        """Take queue places for every sequence (prompts x n), or raise 429 before anything is sent."""
        self.admission.admit(len(self.prompts) * self.params.n, sum(map(len, self.prompts)))
        self._queued = set(range(len(self.prompts)))

    def release(self) -> None:
        """Give back the queue places of prompts that never started; safe to call more than once."""
        self.admission.started(len(self._queued) * self.params.n, sum(len(self.prompts[i]) for i in self._queued))
        self._queued.clear()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, what its output gained) as each engine request advances, all prompts at once."""
        queue: asyncio.Queue = asyncio.Queue()
        params = replace(self.params, output_kind="delta")
        request_ids = [self._engine_request_id(i) for i in range(len(self.prompts))]
        done: set[int] = set()  # finished prompts (outputs the engine sent before an early end's abort may follow)
        finished_cleanly = False
        try:
            for index, request_id in enumerate(request_ids):
                self.engine.add(request_id, self.prompts[index], params, partial(self._arrived, queue, index))
            while len(done) < len(request_ids):
                index, item = await self._next(queue)
                if index in self._queued:
                    self._queued.discard(index)
                    self.admission.started(self.params.n, len(self.prompts[index]))
                if index in done:
                    continue
                if isinstance(item, BaseException):
                    raise item
                if self.ends_early is None:
                    self.final[index] = _joined(self.final.get(index), item)
                else:
                    item = self._join_ending_early(index, item)
                if item.finished:
                    done.add(index)
                    self.engine.release(request_ids[index])
                    self.metrics.observe_finished(self.final[index], Slo(self.params.slo_ttft_ms, self.params.slo_tpot_ms))
                yield index, item
            finished_cleanly = True
        finally:
            # No await here: under a cancelled scope (client gone) awaits fail at once.
            self.release()
            if not finished_cleanly:
                self.metrics.observe_aborted()
            for request_id in request_ids:
                self.engine.release(request_id)  # aborts those still running

    def _join_ending_early(self, index: int, item: RequestOutput) -> RequestOutput:
        """Join item into the prompt's output as _joined does, except for its choices that end early:
        those that did before gain nothing more, those that do now finish as "stop" (over a "length"
        of the same token). The item comes back finished when none of the prompt's choices runs on."""
        ended = self._ended_early.setdefault(index, set())
        item = replace(item, outputs=[_ended(part) if part.index in ended else part for part in item.outputs])
        self.final[index] = _joined(self.final.get(index), item)
        parts = []
        for whole, part in zip(self.final[index].outputs, item.outputs):
            if part.text and part.index not in ended and whole.finish_reason in (None, "length") and \
                    self.ends_early(whole.text, part.text):
                ended.add(part.index)
                whole.finish_reason, whole.stop_reason = "stop", None
                part = replace(part, finish_reason="stop", stop_reason=None)
            parts.append(part)
        finished = item.finished or all(c.finish_reason is not None for c in self.final[index].outputs)
        return replace(item, outputs=parts, finished=finished)

    async def _next(self, queue: asyncio.Queue) -> tuple[int, object]:
        if self.deadline is None:
            return await queue.get()
        try:
            return await asyncio.wait_for(queue.get(), timeout=max(0.0, self.deadline - time.monotonic()))
        except TimeoutError:
            raise DeadlineExceededError("the request did not finish within its timeout; it was aborted") from None

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Per-choice increments; concatenating a choice's deltas gives its final text. With a
        stream_interval of N, a choice's first delta comes at once (its time to first token) and the
        rest at least N tokens at a time, or at its finish: each response chunk costs the event loop
        the same whatever it holds."""
        held: dict[int, ChoiceDelta] = {}
        async with aclosing(self.outputs()) as outputs:
            async for prompt_index, out in outputs:
                for completion in out.outputs:
                    delta = self._delta(prompt_index * self.params.n + completion.index, completion)
                    if delta is None:
                        continue
                    delta = _merged(held.pop(delta.index, None), delta)
                    if self._due(delta):
                        yield delta
                    else:
                        held[delta.index] = delta

    def _due(self, delta: ChoiceDelta) -> bool:
        return (self.stream_interval <= 1 or delta.first or delta.finish_reason is not None
                or len(delta.token_ids) >= self.stream_interval)

    def _delta(self, index: int, completion) -> ChoiceDelta | None:
        sent = self._sent.setdefault(index, _Sent())
        if sent.finished:  # (a finished choice of n > 1 comes again while its siblings run)
            return None
        finished = completion.finish_reason is not None
        if not completion.text and not completion.token_ids and not finished:
            return None
        delta = ChoiceDelta(
            index=index, text=completion.text, token_ids=completion.token_ids, logprobs=completion.logprobs,
            finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
            first=sent.num_tokens == 0 and sent.text_len == 0, text_offset=sent.text_len,
        )
        sent.text_len += len(completion.text)
        sent.num_tokens += len(completion.token_ids)
        sent.finished = finished
        return delta

    async def run(self) -> list[RequestOutput]:
        """Run to completion; the final output of each prompt, in prompt order."""
        async with aclosing(self.outputs()) as outputs:
            async for _ in outputs:
                pass
        return [self.final[i] for i in range(len(self.prompts))]

    def usage(self) -> Usage:
        outs = list(self.final.values())
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in outs)
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client hangs up first (non-streaming responses)."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
            await asyncio.gather(work_task, return_exceptions=True)
    if work_task.cancelled():
        raise ClientDisconnectedError("client disconnected; request aborted")
    return work_task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _merged(earlier: ChoiceDelta | None, later: ChoiceDelta) -> ChoiceDelta:
    """One delta for two consecutive ones of a choice."""
    if earlier is None:
        return later
    logprobs = None if earlier.logprobs is None else earlier.logprobs + (later.logprobs or [])
    return replace(earlier, text=earlier.text + later.text, token_ids=earlier.token_ids + later.token_ids,
                   logprobs=logprobs, finish_reason=later.finish_reason, stop_reason=later.stop_reason)


def _ended(part):
    """A choice's delta after it ended early: nothing gained, still finished."""
    return replace(part, text="", token_ids=[], logprobs=None if part.logprobs is None else [],
                   finish_reason="stop", stop_reason=None)


def _joined(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """A prompt's output so far with the delta after it: the completions joined (the total's own
    lists, grown in place: a delta's may be held unsent by a stream), the other fields the latest."""
    outputs = total.outputs if total is not None else [
        replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else []) for c in delta.outputs]
    for whole, part in zip(outputs, delta.outputs):
        whole.text += part.text
        whole.token_ids.extend(part.token_ids)
        if part.logprobs is not None:
            whole.logprobs.extend(part.logprobs)
        whole.finish_reason, whole.stop_reason = part.finish_reason, part.stop_reason
        whole.cumulative_logprob = part.cumulative_logprob
    return replace(delta, outputs=outputs)
