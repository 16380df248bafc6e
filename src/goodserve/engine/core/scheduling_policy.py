"""The choices a scheduler makes, apart from the mechanism that carries them out.

The scheduler (engine/core/scheduler.py) owns the queues, the KV blocks and the step's layout; a policy
answers its questions: in what order the waiting sequences are admitted and the running ones served,
how many tokens the running ones and the new ones may take this step, whether a sequence may join the
running ones, which one is preempted first, and what a new request can expect (the forecast the
admission check reads, engine/frontend/admission.py). It hears of every sequence that enters or leaves the
queues and of every step planned, refused or run.

Three families, picked by EngineConfig.scheduler_policy (`make_policy`):

- FCFS (this module): "continuous" admits whenever there is room; "static" admits a new batch only
  once the previous one has entirely finished, "dynamic" also once the batch fills up to max_num_seqs
  or the oldest request has waited max_wait_ms (so that a benchmark isolates what continuous batching
  buys);
- "makespan" (engine/core/makespan.py): the longest requests first, the rest spread over the longest one's
  steps, to finish an offline batch of known lengths soonest;
- "slo" (engine/core/slo_policy.py): the queue and the prefill chunks by slack to each request's TTFT
  target, a prompt-token cap per step that keeps the running decodes' TPOT targets, the request with
  the most slack preempted first.

The other two start from FCFS's answers and change those they need. Every policy reads the step-time
model (engine/core/step_time_model.py) the engine fits from its steps, for the forecast at least.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from goodserve.config import EngineConfig
from goodserve.engine.core.sequence import Sequence
from goodserve.engine.core.forecast import Forecast
from goodserve.engine.core.step_time_model import StepTimeModel

if TYPE_CHECKING:
    from goodserve.engine.core.waiting_queue import WaitingQueue


class SchedulingPolicy(Protocol):
    # Whether a waiting sequence may join at any step; if not, whole batches start once
    # next_batch_ready holds (and sequences are neither displaced nor admitted beside a batch).
    admits_any_step: bool
    # The running sequences' tokens, as the policy tallies them for has_room (0: it counts slots only).
    running_tokens: int
    # The prompt tokens this step may carry beside the decodes, where the policy caps them (None: no
    # cap but max_num_batched_tokens): the step trace records it.
    prefill_cap: int | None

    # ---- order ---------------------------------------------------------------------------
    def waiting_key(self, seq: Sequence) -> tuple:
        """The waiting queue's order, smallest first: read once, when seq enters the queue."""

    def running_key(self, seq: Sequence) -> tuple:
        """The order the running sequences are served in, smallest first (decodes lead)."""

    def victim_key(self, seq: Sequence) -> tuple:
        """Larger is preempted (or displaced) first."""

    # ---- what it hears -------------------------------------------------------------------
    def entered_waiting(self, seq: Sequence) -> None: ...

    def left_waiting(self, seq: Sequence) -> None: ...

    def joined(self, seq: Sequence) -> None:
        """seq was admitted this step: it runs from now on."""

    def left(self, seq: Sequence) -> None:
        """seq stopped running this step (preempted, or displaced by a request of a higher priority)."""

    def begin_step(self, running: list[Sequence]) -> None:
        """A step is being planned over these running sequences."""

    def step_refused(self) -> None:
        """The step just planned will not run (one asked for ahead of the step in flight, refused)."""

    def step_ran(self, num_tokens: int) -> None:
        """A step computed num_tokens tokens."""

    # ---- budgets and room ----------------------------------------------------------------
    def running_budget(self) -> int:
        """The tokens the running sequences may take this step."""

    def admission_allowance(self, running: list[Sequence], num_scheduled: int) -> int:
        """The tokens new sequences may take this step, besides num_scheduled for the running ones."""

    def displacement_budget(self) -> int:
        """The prompt tokens of the waiting sequences that may displace running ones this step."""

    def granted(self, seq: Sequence, num_new: int) -> int:
        """Of num_new tokens, those seq may compute this step."""

    def before_admitting(self, waiting: WaitingQueue) -> None:
        """The waiting queue is about to be admitted from: a last reordering."""

    def has_room(self, seq: Sequence, num_running: int, running_tokens: int) -> bool:
        """Whether seq may join num_running sequences of running_tokens tokens in all."""

    def next_batch_ready(self, running: list[Sequence], waiting: WaitingQueue) -> bool:
        """Where a policy admits only between batches: whether the next batch starts now."""

    # ---- what a new request can expect ---------------------------------------------------
    def forecast(self, running: list[Sequence]) -> Forecast:
        """The step-time fit and the queue's shape, for the admission check."""


def decodes_first(seq: Sequence) -> tuple:
    return (seq.num_uncomputed_tokens > 1, *seq.priority_key())


class FcfsPolicy:
    """First come first served, by priority: the waiting and running sequences in (priority,
    arrival) order, decodes first; every step may take max_num_batched_tokens tokens and
    max_num_seqs sequences; the lowest priority, then the latest, is preempted first."""

    admits_any_step = True
    running_tokens = 0
    prefill_cap = None

    def __init__(self, config: EngineConfig, step_time: StepTimeModel) -> None:
        self.config = config
        self.step_time = step_time

    def waiting_key(self, seq: Sequence) -> tuple:
        return seq.priority_key()

    running_key = staticmethod(decodes_first)  # (no method call more a running sequence a step)

    def victim_key(self, seq: Sequence) -> tuple:
        return seq.priority_key()

    def entered_waiting(self, seq: Sequence) -> None:
        pass

    def left_waiting(self, seq: Sequence) -> None:
        pass

    def joined(self, seq: Sequence) -> None:
        pass

    def left(self, seq: Sequence) -> None:
        pass

    def begin_step(self, running: list[Sequence]) -> None:
        pass

    def step_refused(self) -> None:
        pass

    def step_ran(self, num_tokens: int) -> None:
        pass

    def running_budget(self) -> int:
        return self.config.max_num_batched_tokens

    def admission_allowance(self, running: list[Sequence], num_scheduled: int) -> int:
        return self.config.max_num_batched_tokens

    def displacement_budget(self) -> int:
        return self.config.max_num_batched_tokens

    def granted(self, seq: Sequence, num_new: int) -> int:
        return num_new

    def before_admitting(self, waiting: WaitingQueue) -> None:
        pass

    def has_room(self, seq: Sequence, num_running: int, running_tokens: int) -> bool:
        return num_running < self.config.max_num_seqs

    def next_batch_ready(self, running: list[Sequence], waiting: WaitingQueue) -> bool:
        return False

    def forecast(self, running: list[Sequence]) -> Forecast:
        return Forecast(self.step_time.fit, len(running), self.config.max_num_batched_tokens)


class BatchAtATimePolicy(FcfsPolicy):
    """"static" and "dynamic" batching: a new batch starts only once the last one has finished
    ("dynamic": and has filled up to max_num_seqs, or its oldest request has waited max_wait_ms)."""

    admits_any_step = False

    def next_batch_ready(self, running: list[Sequence], waiting: WaitingQueue) -> bool:
        if running or not waiting:
            return False
        if self.config.scheduler_policy == "static" or len(waiting) >= self.config.max_num_seqs:
            return True
        # fewer than max_num_seqs wait: a bounded scan
        oldest_wait_ms = (time.time() - min(s.arrival_time for s in waiting)) * 1000
        return oldest_wait_ms >= self.config.max_wait_ms


def make_policy(config: EngineConfig, step_time: StepTimeModel) -> SchedulingPolicy:
    """The policy config.scheduler_policy names."""
    if config.scheduler_policy == "makespan":
        from goodserve.engine.core.makespan import MakespanPolicy

        return MakespanPolicy(config, step_time)
    if config.scheduler_policy == "slo":
        from goodserve.engine.core.slo_policy import SloPolicy

        return SloPolicy(config, step_time)
    if config.scheduler_policy in ("static", "dynamic"):
        return BatchAtATimePolicy(config, step_time)
    return FcfsPolicy(config, step_time)
