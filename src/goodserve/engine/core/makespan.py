"""Admission for offline batches whose lengths are known: finish the whole batch soonest.

An offline batch (every request submitted at once, outputs of known length: ignore_eos, or
max_tokens close to the real length) cannot finish before its longest request has decoded its
last token, one step per token. Every step reads all the weights, so a decode step of a few
sequences costs nearly as much as one of a hundred (an 8B model on an H100: 5.6 ms at batch 1,
7.9 ms at 256; past that the step grows with the tokens). FCFS continuous batching admits
everything at once: a few hundred big compute-bound steps, then a long tail where the longest
requests decode alone and each step's weight read carries a handful of tokens.

This policy starts the longest requests first (longest-processing-time-first) and then spreads the
remaining work over the steps the longest one needs anyway: each step aims at
slack x (tokens left to compute) / (steps left on the longest request). The shortfall between that
aim and the step's decodes accrues as credit; new requests are admitted once the credit reaches
min_admit tokens, so prefill chunks come in lumps rather than every step (a step with a prefill
chunk replays a mixed-step graph; its host work costs more than a decode step's). A request that
would otherwise outlast the longest one is admitted at once: with equal lengths the policy is FCFS.
slack (1.5: aim above the even spread, early steps are cheaper to fill than late ones are to rescue)
and min_admit (512) are EngineConfig's makespan_slack and makespan_min_admit.
"""

from __future__ import annotations

from goodserve.config import EngineConfig
from goodserve.engine.core.scheduling_policy import FcfsPolicy
from goodserve.engine.core.sequence import Sequence
from goodserve.engine.core.step_time_model import StepTimeModel
from goodserve.engine.core.waiting_queue import WaitingQueue

# A waiting request is admitted, credit or not, once it has at most this many steps to spare.
DEADLINE_MARGIN = 2


def remaining_outputs(seq: Sequence) -> int:
    return seq.max_len - seq.num_tokens


def longest_first_key(seq: Sequence) -> tuple:
    """Waiting order: priority first, then the request with the most tokens left to generate."""
    return (seq.params.priority, -remaining_outputs(seq), seq.arrival_time, seq.seq_id)


class MakespanPolicy(FcfsPolicy):
    """FCFS but for the waiting order (longest first) and the admission allowance: its credit, step by
    step. It keeps its own index of the waiting sequences (the scheduler tells it who enters and leaves
    the queue), so a step costs the running sequences and the few waiting ones near the deadline, not
    the queue."""

    def __init__(self, config: EngineConfig, step_time: StepTimeModel) -> None:
        super().__init__(config, step_time)
        self.slack, self.min_admit = config.makespan_slack, config.makespan_min_admit
        self.credit = 0.0  # tokens the steps so far fell short of their aim (negative: ran ahead)
        self.aim = 0.0  # the last step's aim, tokens
        self.max_admit = config.max_num_batched_tokens  # no step admits more prompt tokens
        self.waiting = WaitingQueue(key=lambda seq: -remaining_outputs(seq))  # most tokens left to generate first
        self.waiting_tokens_left = 0  # waiting sequences hold no computed tokens: the sum of their max_len

    def waiting_key(self, seq: Sequence) -> tuple:
        return longest_first_key(seq)

    def entered_waiting(self, seq: Sequence) -> None:
        self.waiting.add(seq)
        self.waiting_tokens_left += seq.max_len

    def left_waiting(self, seq: Sequence) -> None:
        if self.waiting.remove(seq):
            self.waiting_tokens_left -= seq.max_len

    def admission_allowance(self, running: list[Sequence], num_scheduled: int) -> int:
        """Prompt tokens that new requests may take this step, besides the num_scheduled tokens of the
        running sequences. Reads the queues; changes nothing until `step_ran`."""
        steps_left = self._steps_left(running)
        tokens_left = sum(seq.max_len - seq.num_computed_tokens for seq in running) + self.waiting_tokens_left
        self.aim = self.slack * tokens_left / steps_left
        room = self.credit + self.aim - num_scheduled
        due = self._prompt_tokens_due(steps_left)
        if not running:
            return max(int(room), due, 1)
        return max(int(room) if room >= self.min_admit else 0, due)

    def step_ran(self, num_tokens: int) -> None:
        """A step ran num_tokens tokens against the last aim."""
        self.credit += self.aim - num_tokens

    def _steps_left(self, running: list[Sequence]) -> int:
        longest = self.waiting.peek()
        return 1 + max([remaining_outputs(seq) for seq in running] + ([remaining_outputs(longest)] if longest else []))

    def _prompt_tokens_due(self, steps_left: int) -> int:
        """Prompt tokens of the waiting requests that would outlast the batch if not started now (all
        of them when every answer has the same length), counted up to what one step admits."""
        due = 0
        for seq in self.waiting.leading(lambda key: -key + DEADLINE_MARGIN >= steps_left):
            due += seq.num_uncomputed_tokens
            if due >= self.max_admit:
                break
        return due
