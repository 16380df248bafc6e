"""Admission control: a bounded waiting queue, so overload is a fast 429 instead of a slow timeout.

The engine's front end: whoever hands requests to the engine checks them here first (the server,
the in-process load generator, a batch run). "Waiting" means admitted to the engine but not yet
producing tokens. The caller counts these itself (the server all on its event loop, so no locking
and no lag behind the engine thread's stats), in sequences: a request with 50 prompts and n=128
takes 6,400 places, as it makes 6,400 sequences; and in prompt tokens, the prefill work queued ahead
of a new request.

Under the "slo" scheduler policy a request with a TTFT target is also refused (429, Retry-After)
when its TTFT cannot be met: the scheduling policy's forecast (engine/core/forecast.py, a snapshot the
engine publishes after each step, read here without waiting on it) predicts the time to compute
the prompt tokens waiting ahead and its own. A client that sets slo_best_effort is queued instead,
at BEST_EFFORT_PRIORITY: after every request that can still meet its target, before batch lines.

With --slo-shed-costly the check sheds the costliest requests first as the queue builds. A request's
cost is the device time it adds over its life by the fit (its prompt tokens, and max_tokens decode
rows reading a growing context: StepTimeFit.request_seconds; a request without max_tokens asks for
the rest of the context), ranked q in [0, 1] among the last SHED_WINDOW requests checked; it waits at
most (1 - SHED_STRENGTH x q^SHED_POWER) x its TTFT target, so as the predicted queue grows the most
expensive are refused first and the cheap keep the whole target. Goodput counts requests: under
overload the requests a second that meet their targets are the most when the work refused is the
largest per request refused. ShareGPT-like answers are long-tailed (the tenth longest carry about a
third of the tokens). On the simulated clock at the H200's fit and the card's own requests (dummy
llama-3.1-8b, TTFT 200 ms, TPOT 50 ms; benchmarks/BENCHMARKS.md) slo's 90% crossing went from 1.04x
FCFS's to 1.27x; not measured on a card yet. The price is the long requests' 429s, more of them the
longer they are, from a lighter load than their own target would refuse them at: opt-in. It ranks by
max_tokens, so it sheds well only where clients set it near what they need.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

from goodserve.engine.core.forecast import Forecast
from goodserve.engine.core.step_time_model import StepTimeFit
from goodserve.errors import InvalidRequestError, QueueFullError

BEST_EFFORT_PRIORITY = 1 << 29  # batch lines run at 1 << 30 (server/batch_lines.py)


class QueueFull(QueueFullError):
    def __init__(self, max_waiting: int, retry_after_s: int):
        super().__init__(
            f"the server's waiting queue is full ({max_waiting} sequences); retry in {retry_after_s}s"
        )
        self.retry_after_s = retry_after_s


class TtftUnattainable(QueueFullError):
    def __init__(self, predicted_ms: float, target_ms: float, retry_after_s: int):
        super().__init__(
            f"the time to first token this request asks for ({target_ms:g} ms) cannot be met: the queue "
            f"ahead of it takes {predicted_ms:.0f} ms; retry in {retry_after_s}s, or send "
            f"slo_best_effort: true to wait at a lower priority")
        self.retry_after_s = retry_after_s


class CostlyRequestShed(QueueFullError):
    def __init__(self, predicted_ms: float, allowed_ms: float, rank: float, retry_after_s: int):
        super().__init__(
            f"the server is shedding its costliest requests first (--slo-shed-costly): this one's prompt and "
            f"max_tokens cost more than {100 * rank:.0f}% of recent requests', so it may wait {allowed_ms:.0f} ms "
            f"and the queue ahead of it takes {predicted_ms:.0f} ms; retry in {retry_after_s}s, ask for fewer "
            f"max_tokens, or send slo_best_effort: true to wait at a lower priority")
        self.retry_after_s = retry_after_s


SHED_WINDOW = 512  # requests a new one's cost is ranked among
SHED_MIN_RANKED = 64  # fewer ranked so far: no shedding
SHED_STRENGTH = 0.9  # the costliest request may wait 1 - this of its TTFT target
SHED_POWER = 2.0  # how fast the wait allowed falls with the cost's rank: the costliest shed first


class CostRanks:
    """Where a cost falls among the last `window` costs ranked (0: the cheapest, 1: the costliest)."""

    def __init__(self, window: int = SHED_WINDOW) -> None:
        self.sorted: list[float] = []
        self.arrived: deque[float] = deque()  # the same costs, oldest first
        self.window = window

    def rank(self, cost: float) -> float | None:
        """cost's rank among those before it (None: fewer than SHED_MIN_RANKED), then cost ranked too."""
        rank = bisect.bisect_left(self.sorted, cost) / len(self.sorted) if len(self.sorted) >= SHED_MIN_RANKED else None
        bisect.insort(self.sorted, cost)
        self.arrived.append(cost)
        if len(self.arrived) > self.window:
            del self.sorted[bisect.bisect_left(self.sorted, self.arrived.popleft())]
        return rank


class Admission:
    def __init__(self, max_waiting: int, retry_after_s: int = 1, shed_costly: bool = False):
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
        self.num_waiting = 0
        self.waiting_prompt_tokens = 0  # of the waiting sequences
        self.costs = CostRanks() if shed_costly else None

    def check_ttft(self, forecast: Forecast, prompt_tokens: int, ttft_ms: float, output_tokens: int = 0) -> None:
        """Raise TtftUnattainable if prompt_tokens queued behind the waiting ones would miss ttft_ms;
        shedding costly requests, CostlyRequestShed if they would wait longer than its cost's rank allows.
        Retry-After: the seconds the queue ahead needs to drain that far."""
        predicted_s = forecast.ttft_seconds(self.waiting_prompt_tokens, prompt_tokens, self.num_waiting)
        if predicted_s is None:
            return
        rank = self._cost_rank(forecast.fit, prompt_tokens, output_tokens)
        allowed_ms = ttft_ms * (1.0 - SHED_STRENGTH * rank ** SHED_POWER) if rank is not None else ttft_ms
        if predicted_s * 1000 <= allowed_ms:
            return
        retry_after_s = max(1, math.ceil(predicted_s - allowed_ms / 1000))
        if predicted_s * 1000 <= ttft_ms:
            raise CostlyRequestShed(predicted_s * 1000, allowed_ms, rank, retry_after_s)
        raise TtftUnattainable(predicted_s * 1000, ttft_ms, retry_after_s)

    def _cost_rank(self, fit: StepTimeFit, prompt_tokens: int, output_tokens: int) -> float | None:
        if self.costs is None:
            return None
        return self.costs.rank(fit.request_seconds(prompt_tokens, output_tokens))

    def admit(self, num_seqs: int, prompt_tokens: int = 0) -> None:
        """Reserve queue places for one API call's sequences (prompts x n), or refuse them all."""
        if num_seqs > self.max_waiting:
            raise InvalidRequestError(
                f"this request makes {num_seqs} sequences (prompts x n), more than the waiting queue "
                f"holds (--max-waiting {self.max_waiting}): send fewer prompts or a smaller n"
            )
        if self.num_waiting + num_seqs > self.max_waiting:
            raise QueueFull(self.max_waiting, self.retry_after_s)
        self.num_waiting += num_seqs
        self.waiting_prompt_tokens += prompt_tokens

    def started(self, num_seqs: int, prompt_tokens: int = 0) -> None:
        """Sequences that produced their first output (or ended) leave the queue."""
        self.num_waiting -= num_seqs
        self.waiting_prompt_tokens -= prompt_tokens
