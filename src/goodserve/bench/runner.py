"""Drives a target with a workload on an arrival schedule and collects every request's record.

Records land in `BenchRun.records` as requests finish, so a run cut short (Ctrl-C, a dying
server) still leaves every finished request to report.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol

from goodserve.bench.arrivals import ArrivalConfig, send_offsets
from goodserve.bench.client import Clock, monotonic_clock
from goodserve.bench.records import RequestRecord
from goodserve.bench.workloads import BenchRequest

ProgressHook = Callable[[RequestRecord], None]


class Target(Protocol):
    description: str

    async def send(self, request: BenchRequest, index: int, clock: Clock) -> RequestRecord: ...

    async def close(self) -> None: ...


@dataclass
class _Conversation:
    """Multi-turn state: the messages so far and when the latest turn finished."""

    history: list[dict] = field(default_factory=list)
    turn_done: dict[int, asyncio.Event] = field(default_factory=dict)

    def done_event(self, turn: int) -> asyncio.Event:
        return self.turn_done.setdefault(turn, asyncio.Event())


@dataclass
class BenchRun:
    target: Target
    requests: list[BenchRequest]
    arrivals: ArrivalConfig
    seed: int = 0
    # Sent first, their records dropped; prompts of their own, so that they leave no measured
    # prompt in the server's prefix cache.
    warmups: list[BenchRequest] = field(default_factory=list)
    on_record: ProgressHook | None = None
    on_start: Callable[[], None] | None = None  # after the warm-up, before the first measured request
    records: list[RequestRecord] = field(default_factory=list)

    async def run(self) -> list[RequestRecord]:
        await self._warm_up()
        if self.on_start:
            self.on_start()
        clock = monotonic_clock()
        offsets = send_offsets(self.arrivals, len(self.requests), self.seed)
        limit = self.arrivals.max_concurrency
        semaphore = asyncio.Semaphore(limit) if limit else None
        conversations: dict[int, _Conversation] = {}
        tasks = [asyncio.create_task(self._one(i, r, offsets[i], clock, semaphore, conversations))
                 for i, r in enumerate(self.requests)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        self.records.sort(key=lambda r: r.index)
        return self.records

    async def _warm_up(self) -> None:
        """Requests whose records are dropped: they pay for lazy init, compilation, cold caches."""
        if not self.warmups:
            return
        clock = monotonic_clock()
        warmups = [BenchRequest(r.prompt, r.prompt_len, r.output_len) for r in self.warmups]  # no turns
        await asyncio.gather(*(self.target.send(r, -1, clock) for r in warmups))

    async def _one(self, index: int, request: BenchRequest, due: float, clock: Clock,
                   semaphore: asyncio.Semaphore | None, conversations: dict[int, _Conversation]) -> None:
        delay = due - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        conversation = None
        if request.conversation_id is not None:
            conversation = conversations.setdefault(request.conversation_id, _Conversation())
            if request.turn > 0:
                await conversation.done_event(request.turn - 1).wait()
            request.history = list(conversation.history)
        if semaphore is None:
            record = await self.target.send(request, index, clock)
        else:
            async with semaphore:
                record = await self.target.send(request, index, clock)
        if conversation is not None:
            conversation.history += [{"role": "user", "content": request.prompt},
                                     {"role": "assistant", "content": record.generated_text}]
            conversation.done_event(request.turn).set()
        self.records.append(record)
        if self.on_record:
            self.on_record(record)


class _OutOfTime(Exception):
    """The caller's time for the search ran out: the probes so far answer."""


async def search_capacity(attainment_at: Callable[[float], Awaitable[float]], target: float,
                          start_rate: float, max_doublings: int = 8, bisections: int = 4,
                          out_of_time: Callable[[], bool] = lambda: False, resolution: float = 0.0,
                          min_rate: float = 0.0) -> tuple[float, list[tuple[float, float]]]:
    """DistServe's per-GPU goodput: the highest request rate whose SLO attainment stays >= target.

    Doubles the rate until attainment drops below target (halves first if the start already
    fails, never below `min_rate`: a caller that only needs to know whether the capacity beats a
    rate spares itself ever longer probes of one far below), then bisects between the last passing
    and first failing rate, at most `bisections` times and only while the failing rate is more than
    `resolution` (a fraction) above the passing one: closer than a probe's noise, another probe
    would be a coin toss. Returns the highest passing rate (0.0 if none passed) and every (rate,
    attainment) probed. No probe after the first starts once `out_of_time()` says so (a caller's
    time budget): the rate found so far answers.
    """
    probes: list[tuple[float, float]] = []

    async def passes(rate: float) -> bool:
        if probes and out_of_time():
            raise _OutOfTime
        attainment = await attainment_at(rate)
        probes.append((rate, attainment))
        return attainment >= target

    try:
        return await _search(passes, start_rate, max_doublings, bisections, resolution, min_rate), probes
    except _OutOfTime:
        return max((rate for rate, attainment in probes if attainment >= target), default=0.0), probes


async def _search(passes: Callable[[float], Awaitable[bool]], start_rate: float, max_doublings: int,
                  bisections: int, resolution: float, min_rate: float) -> float:
    """Doubles (or halves) from the start rate to a pass/fail pair, then bisects between them."""
    good, bad = 0.0, None
    rate = start_rate
    if await passes(rate):
        good = rate
        for _ in range(max_doublings):
            rate *= 2
            if not await passes(rate):
                bad = rate
                break
            good = rate
    else:
        bad = rate
        for _ in range(max_doublings):
            rate /= 2
            if rate < min_rate:
                break
            if await passes(rate):
                good = rate
                break
            bad = rate
    if bad is not None and good > 0:
        for _ in range(bisections):
            if bad - good <= resolution * good:
                break
            mid = (good + bad) / 2
            if await passes(mid):
                good = mid
            else:
                bad = mid
    return good
