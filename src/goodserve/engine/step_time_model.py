"""How long a step takes, as a function of its shape, fitted online from the engine's measured steps.

A step's time is close to linear in its two sizes: t = a + b x decode_rows + c x prefill_tokens.
`a` is the weight read and launch cost every step pays, `b` each decode row's attention and
sampling, `c` each prompt token's compute. The engine feeds every step it finishes; the fit is
ordinary least squares over the last `window` steps with prompt tokens and the last `window`
without (kept apart so a long run of decode-only steps does not push out what says what a prompt
token costs), redone every `refit_every` steps (a 3-column solve over a few hundred rows: tens of
microseconds). Used by the "slo" scheduler policy to cap
the prefill tokens mixed into a step (running decodes keep their TPOT) and by the server's
admission check to predict a new request's time to first token (server/admission.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from goodserve.engine.scheduler_output import SchedulerOutput

MIN_STEPS = 8  # fewer steps than this: no prediction
# The fit needs steps of different shapes; a run of identical ones says nothing about b or c.
_MIN_DISTINCT_SHAPES = 3
_UNBOUNDED = 1 << 30  # prompt tokens or decode rows a step may carry when they cost nothing measurable


@dataclass(frozen=True)
class StepTimeFit:
    """t = a + b x decode_rows + c x prefill_tokens, in seconds."""

    a: float
    b: float
    c: float

    def seconds(self, decode_rows: int, prefill_tokens: int) -> float:
        return self.a + self.b * decode_rows + self.c * prefill_tokens

    def max_prefill_tokens(self, decode_rows: int, step_budget_s: float) -> int:
        """The most prompt tokens a step with decode_rows decodes may carry and still last at most
        step_budget_s (0 when the decodes alone take longer)."""
        room = step_budget_s - self.seconds(decode_rows, 0)
        if room <= 0:
            return 0
        # (+1e-6: 0.02 / 2e-5 is 999.99...)
        return _UNBOUNDED if self.c <= 0 else min(int(room / self.c + 1e-6), _UNBOUNDED)

    def max_decode_rows(self, step_budget_s: float) -> int:
        """The most decode rows a step without prompt tokens may carry and still last at most
        step_budget_s (0 when even an empty step takes longer)."""
        room = step_budget_s - self.a
        if room < 0:
            return 0
        return _UNBOUNDED if self.b <= 0 else min(int(room / self.b + 1e-6), _UNBOUNDED)

    def prefill_seconds(self, prompt_tokens: int, decode_rows: int, tokens_per_step: int) -> float:
        """Time to compute prompt_tokens in chunks of tokens_per_step beside decode_rows decodes."""
        if prompt_tokens <= 0:
            return 0.0
        full, rest = divmod(prompt_tokens, max(tokens_per_step, 1))
        return full * self.seconds(decode_rows, tokens_per_step) + (self.seconds(decode_rows, rest) if rest else 0.0)


class StepTimeModel:
    def __init__(self, window: int = 128, refit_every: int = 16) -> None:
        self.decode_steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        self.mixed_steps: deque[tuple[int, int, float]] = deque(maxlen=window)  # with prompt tokens
        self.refit_every = refit_every
        self.fit: StepTimeFit | None = None  # None until MIN_STEPS steps of enough shapes were seen
        self.last_seconds = 0.0  # the latest step's time, as measured
        self._since_fit = 0

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        (self.mixed_steps if prefill_tokens else self.decode_steps).append((decode_rows, prefill_tokens, seconds))
        self.last_seconds = seconds
        self._since_fit += 1
        if self._since_fit >= self.refit_every or self.fit is None:
            self.refit()

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """A step's time (from its launch, or, pipelined, from the step before it reaching the host:
        the interval at which its decodes got their tokens); a decode row is one token, or one and
        its drafts to verify."""
        prompt_rows = [n for row, n in enumerate(out.num_new_tokens) if n > 1 and row not in out.draft_token_ids]
        self.observe(len(out) - len(prompt_rows), sum(prompt_rows), seconds)

    def refit(self) -> None:
        self._since_fit = 0
        samples = [*self.decode_steps, *self.mixed_steps]
        if len(samples) < MIN_STEPS or len({s[:2] for s in samples}) < _MIN_DISTINCT_SHAPES:
            return
        rows = np.asarray(samples, dtype=np.float64)
        design = np.column_stack([np.ones(len(rows)), rows[:, 0], rows[:, 1]])
        (a, b, c), *_ = np.linalg.lstsq(design, rows[:, 2], rcond=None)
        # A negative cost per row or token is noise (e.g. no decode rows varied): read it as free.
        self.fit = StepTimeFit(max(float(a), 0.0), max(float(b), 0.0), max(float(c), 0.0))
