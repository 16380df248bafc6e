"""What a new request can expect from the engine: the step-time fit and the queue's shape, as the
scheduling policy sees them after each step (SchedulingPolicy.forecast). The engine's thread (or
process) publishes it; the admission check (engine/frontend/admission.py) reads it without waiting on the
engine, to refuse a request whose TTFT target the queue ahead of it already makes impossible."""

from __future__ import annotations

from dataclasses import dataclass

from goodserve.engine.core.step_time_model import StepTimeFit


@dataclass(frozen=True)
class Forecast:
    """What the admission check needs from the engine, published by its thread after every step."""

    fit: StepTimeFit | None
    decode_rows: int  # in the steps a new request will share: targeted rows, and the background share's
    prefill_tokens_per_step: int  # the step's prefill cap now
    context_tokens: int = 0  # the K/V those decode rows read (their lengths, summed)
    free_seqs: int = 1 << 30  # the sequences that may run (max_running) - those a new request cannot displace
    # The running sequences' steps left (tokens they may still generate), ascending: when slots free
    # up. Exact with ignore_eos; otherwise max_tokens is an upper bound, and the forecast pessimistic.
    steps_to_finish: tuple[int, ...] = ()
    # Of the requests with targets that have not answered yet (the admission check counts them as
    # waiting ahead), those not ahead of a new one: running (a slot already theirs) or ranked behind it
    # (late, or of a lower priority); and their prompt tokens that are computed or ranked behind.
    seqs_not_ahead: int = 0
    prompt_tokens_not_ahead: int = 0
    # The latest step's time: a request arriving while one runs joins the step after it, half a step
    # later on average.
    step_seconds: float = 0.0

    def ttft_seconds(self, prompt_tokens_ahead: int, prompt_tokens: int, seqs_ahead: int = 0) -> float | None:
        """Predicted time to first token of a request queued behind seqs_ahead sequences holding
        prompt_tokens_ahead prompt tokens (the admission check's count: every request that has not
        answered yet, less what the engine knows is not ahead): its prompt starts once those ahead are
        computed and a sequence slot is free, whichever comes last."""
        if self.fit is None:
            return None
        prompt_tokens_ahead = max(prompt_tokens_ahead - self.prompt_tokens_not_ahead, 0)
        seqs_ahead = max(seqs_ahead - self.seqs_not_ahead, 0)
        both = self.fit.prefill_seconds(prompt_tokens_ahead + prompt_tokens, self.decode_rows,
                                        self.prefill_tokens_per_step, self.context_tokens)
        own = self.fit.prefill_seconds(prompt_tokens, self.decode_rows, self.prefill_tokens_per_step,
                                       self.context_tokens)
        return self.step_seconds / 2 + max(both, self._slot_wait_seconds(seqs_ahead) + own)

    def _slot_wait_seconds(self, seqs_ahead: int) -> float:
        short = seqs_ahead + 1 - self.free_seqs  # running sequences that must finish first
        if short <= 0 or not self.steps_to_finish:
            return 0.0
        rounds, i = divmod(short - 1, len(self.steps_to_finish))  # past one batch: it turns over again
        steps = rounds * self.steps_to_finish[-1] + self.steps_to_finish[i]
        return steps * self.fit.seconds(self.decode_rows, 0, self.context_tokens)
