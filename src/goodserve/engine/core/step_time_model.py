"""How long a step takes, as a function of its shape, fitted online from the engine's measured steps.

A step's time is close to linear in three sizes: t = a + b x decode_rows + c x prefill_tokens +
d x context_tokens. `a` is the weight read and launch cost every step pays, `b` each decode row's
sampling and fixed attention cost, `c` each prompt token's compute, `d` each token of K/V a decode
row's attention reads (context_tokens: the decode rows' lengths, summed). Without `d` the fit read
the KV cache as a cost per row at the rows' mean length so far: a batch job's long lines, whose
contexts grow, made steps slower than predicted and online TPOT missed (H100, benchmarks/BENCHMARKS.md). A prompt
chunk's attention over its own prefix is compute, in `c`.

The engine feeds every step it finishes; the fit is least squares over the last `window` steps with
prompt tokens and the last `window` without (kept apart so a long run of decode-only steps does not
push out what says what a prompt token costs), redone every `refit_every` steps (a 4-column solve
over a few hundred rows: tens of microseconds). Every coefficient is at least 0 (a negative cost is
noise: the solve drops that column and redoes the rest). Decode rows and their contexts move
together (a batch of similar lengths), and both with the steps' count, so the data alone may not
tell `a`, `b` and `d` apart: priors hold `d` near the roofline's `a` x kv_read_ratio (a token's K/V
bytes over the weights' bytes: a memory-bound step reads both at the same bandwidth) and `b` near
`a` x row_compute_ratio (a token's matmuls at peak FLOP/s over the weights' read at peak bandwidth),
each worth PRIOR_STEPS steps, which the steps outweigh where their shapes do tell them apart. Without
the second, on the H100 beside a batch job (rows and contexts growing together) the solve put `b` at 0
and `a` took its share: the slo policy's background share then charged a batch row its context's
read alone, ~8 us, and let ~35 rows into steps it meant to lengthen by 10% (+45%; online attainment
99.3 -> 94.0%, benchmarks/BENCHMARKS.md).

It also tracks how wrong it is: an EWMA of |measured - predicted| / predicted over the steps it had
a fit for (`relative_error`), which the "slo" policy plans against (a margin that grows with it).
Used by the "slo" scheduler policy (engine/core/slo_policy.py) to cap the sequences that run and the
prefill tokens mixed into a step, and by the server's admission check to predict a new request's
time to first token (engine/frontend/admission.py).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from goodserve.engine.seam.scheduler_output import SchedulerOutput

MIN_STEPS = 8  # fewer steps than this: no prediction
# The fit needs steps of different shapes; a run of identical ones says nothing about b, c or d.
_MIN_DISTINCT_SHAPES = 3
_UNBOUNDED = 1 << 30  # prompt tokens or decode rows a step may carry when they cost nothing measurable
PRIOR_STEPS = 4.0  # what each roofline prior (b, d) weighs, in steps
ERROR_EWMA = 0.05  # the prediction error's smoothing: about the last 20 steps
MAX_STEP_ERROR = 1.0  # one step's relative error counts at most this much (a GC pause is not the fit)


@dataclass(frozen=True)
class StepTimeFit:
    """t = a + b x decode_rows + c x prefill_tokens + d x context_tokens, in seconds."""

    a: float
    b: float
    c: float
    d: float = 0.0

    def seconds(self, decode_rows: int, prefill_tokens: int, context_tokens: float = 0) -> float:
        return self.a + self.b * decode_rows + self.c * prefill_tokens + self.d * context_tokens

    def request_seconds(self, prompt_tokens: int, output_tokens: int) -> float:
        """The device time a request adds to the steps it shares, over its life: its prompt's tokens,
        then a decode row a token, reading its context as it grows (the steps' own cost, a, is shared)."""
        return self.c * prompt_tokens + output_tokens * (self.b + self.d * (prompt_tokens + output_tokens / 2))

    def max_prefill_tokens(self, decode_rows: int, step_budget_s: float, context_tokens: float = 0) -> int:
        """The most prompt tokens a step with decode_rows decodes reading context_tokens may carry and
        still last at most step_budget_s (0 when the decodes alone take longer)."""
        room = step_budget_s - self.seconds(decode_rows, 0, context_tokens)
        if room <= 0:
            return 0
        # (+1e-6: 0.02 / 2e-5 is 999.99...)
        return _UNBOUNDED if self.c <= 0 else min(int(room / self.c + 1e-6), _UNBOUNDED)

    def max_decode_rows(self, step_budget_s: float, mean_context: float = 0.0) -> int:
        """The most decode rows of mean_context tokens each a step without prompt tokens may carry and
        still last at most step_budget_s (0 when even an empty step takes longer)."""
        room = step_budget_s - self.a
        if room < 0:
            return 0
        per_row = self.b + self.d * mean_context
        return _UNBOUNDED if per_row <= 0 else min(int(room / per_row + 1e-6), _UNBOUNDED)

    def prefill_seconds(self, prompt_tokens: int, decode_rows: int, tokens_per_step: int,
                        context_tokens: float = 0) -> float:
        """Time to compute prompt_tokens in chunks of tokens_per_step beside decode_rows decodes."""
        if prompt_tokens <= 0:
            return 0.0
        full, rest = divmod(prompt_tokens, max(tokens_per_step, 1))
        step = self.seconds(decode_rows, tokens_per_step, context_tokens)
        return full * step + (self.seconds(decode_rows, rest, context_tokens) if rest else 0.0)


class StepTimeModel:
    def __init__(self, window: int = 128, refit_every: int = 16, kv_read_ratio: float = 0.0,
                 row_compute_ratio: float = 0.0) -> None:
        # (decode_rows, prefill_tokens, context_tokens, seconds)
        self.decode_steps: deque[tuple[int, int, int, float]] = deque(maxlen=window)
        self.mixed_steps: deque[tuple[int, int, int, float]] = deque(maxlen=window)  # with prompt tokens
        self.refit_every = refit_every
        self.kv_read_ratio = kv_read_ratio  # the priors: d = a x this, b = a x row_compute_ratio (0: none)
        self.row_compute_ratio = row_compute_ratio
        self.fit: StepTimeFit | None = None  # None until MIN_STEPS steps of enough shapes were seen
        self.last_seconds = 0.0  # the latest step's time, as measured
        self.relative_error = 0.0  # EWMA of |measured - predicted| / predicted, over steps with a fit
        self._since_fit = 0

    def observe(self, decode_rows: int, prefill_tokens: int, context_tokens: int, seconds: float) -> None:
        if self.fit is not None:
            self._track_error(self.fit.seconds(decode_rows, prefill_tokens, context_tokens), seconds)
        step = (decode_rows, prefill_tokens, context_tokens, seconds)
        (self.mixed_steps if prefill_tokens else self.decode_steps).append(step)
        self.last_seconds = seconds
        self._since_fit += 1
        if self._since_fit >= self.refit_every or self.fit is None:
            self.refit()

    def _track_error(self, predicted: float, measured: float) -> None:
        if predicted <= 0:
            return
        error = min(abs(measured - predicted) / predicted, MAX_STEP_ERROR)
        self.relative_error += ERROR_EWMA * (error - self.relative_error)

    def refit(self) -> None:
        self._since_fit = 0
        samples = [*self.decode_steps, *self.mixed_steps]
        if len(samples) < MIN_STEPS or len({s[:3] for s in samples}) < _MIN_DISTINCT_SHAPES:
            return
        steps = np.asarray(samples, dtype=np.float64)
        design = np.column_stack([np.ones(len(steps)), steps[:, :3]])
        times = steps[:, 3]
        # each prior as one more row: (coefficient - ratio x a) x its size in a typical step = 0
        for column, ratio in ((1, self.row_compute_ratio), (3, self.kv_read_ratio)):
            if ratio > 0:
                prior = np.zeros(4)
                prior[0], prior[column] = -ratio, 1.0
                typical = math.sqrt(float(np.mean(steps[:, column - 1] ** 2)))
                design = np.vstack([design, math.sqrt(PRIOR_STEPS) * typical * prior])
                times = np.append(times, 0.0)
        self.fit = StepTimeFit(*_nonnegative_least_squares(design, times))


def decode_rows_of(out: SchedulerOutput) -> list[int]:
    """A step's decode rows: one token each, or one and its drafts to verify."""
    return [row for row, n in enumerate(out.num_new_tokens) if n == 1 or row in out.draft_token_ids]


def step_shape(out: SchedulerOutput) -> tuple[int, int, int]:
    """A step's (decode_rows, prefill_tokens, context_tokens): a decode row reads its whole length's K/V."""
    decode_rows = decode_rows_of(out)
    decode_tokens = sum(out.num_new_tokens[row] for row in decode_rows)
    context = sum(out.num_computed_tokens[row] for row in decode_rows) + decode_tokens
    return len(decode_rows), out.num_tokens - decode_tokens, context


def _nonnegative_least_squares(design: np.ndarray, target: np.ndarray) -> list[float]:
    """Least squares with every coefficient >= 0: solve, drop the most negative column (its
    coefficient is 0), solve again (an active-set pass; a handful of columns, so at most as many solves)."""
    free = list(range(design.shape[1]))
    while True:
        solution, *_ = np.linalg.lstsq(design[:, free], target, rcond=None)
        worst = int(np.argmin(solution))
        if solution[worst] >= 0:
            coefs = [0.0] * design.shape[1]
            for column, value in zip(free, solution):
                coefs[column] = float(value)
            return coefs
        free.pop(worst)
        if not free:
            return [0.0] * design.shape[1]
