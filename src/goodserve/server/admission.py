"""Admission control: a bounded waiting queue, so overload is a fast 429 instead of a slow timeout.

"Waiting" means admitted to the engine but not yet producing tokens. The server counts these
itself (all on the event loop, so no locking and no lag behind the engine thread's stats), in
sequences: a request with 50 prompts and n=128 takes 6,400 places, as it makes 6,400 sequences;
and in prompt tokens, the prefill work queued ahead of a new request.

Under the "slo" scheduler policy a request with a TTFT target is also refused (429, Retry-After)
when its TTFT cannot be met: the engine's step-time fit (engine/slo_policy.SloForecast, a snapshot
its thread publishes after each step, read here without waiting on it) predicts the time to compute
the prompt tokens waiting ahead and its own. A client that sets slo_best_effort is queued instead,
at BEST_EFFORT_PRIORITY: after every request that can still meet its target, before batch lines.
"""

from __future__ import annotations

import math

from goodserve.engine.slo_policy import SloForecast
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


class Admission:
    def __init__(self, max_waiting: int, retry_after_s: int = 1):
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
        self.num_waiting = 0
        self.waiting_prompt_tokens = 0  # of the waiting sequences

    def check_ttft(self, forecast: SloForecast, prompt_tokens: int, ttft_ms: float) -> None:
        """Raise TtftUnattainable if prompt_tokens queued behind the waiting ones would miss ttft_ms.
        Retry-After: the seconds the queue ahead needs to drain that far."""
        predicted_s = forecast.ttft_seconds(self.waiting_prompt_tokens, prompt_tokens, self.num_waiting)
        if predicted_s is None or predicted_s * 1000 <= ttft_ms:
            return
        raise TtftUnattainable(predicted_s * 1000, ttft_ms, max(1, math.ceil(predicted_s - ttft_ms / 1000)))

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
