"""One bad request never fails another: finding the sequences that make a step fail.

A step that raises while building its inputs, running the model or sampling has changed nothing the
engine keeps (the scheduler advances sequences only after sampling), except K/V written into the
step's own slots, which a rerun writes again, and seeded generators' noise, which `rewind_generators`
gives back. So the step can be retried on parts of its batch: bisection finds the sequences that
fail alone (2 log2(n) trials for one culprit among n), the engine fails their requests with their
own error and runs the rest as the step it would have been.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from goodserve.engine.seam.scheduler_output import SchedulerOutput
from goodserve.ops.sampler import SamplingBatch


def find_culprits(out: SchedulerOutput, error: Exception,
                  trial: Callable[[SchedulerOutput, list[int]], object]) -> list[tuple[int, Exception]]:
    """The rows of a step that failed with `error` which fail on their own, with their errors.
    `trial` runs the step's given rows without keeping anything; none found: the failure needs the
    whole step."""
    culprits = []

    def bisect(rows: list[int], failure: Exception) -> None:
        if len(rows) == 1:
            culprits.append((rows[0], failure))
            return
        middle = len(rows) // 2
        for half in (rows[:middle], rows[middle:]):
            try:
                trial(out.select(half), half)
            except Exception as exc:  # noqa: BLE001 - any error a request can cause
                bisect(half, exc)

    bisect(list(range(len(out))), error)
    return culprits


@contextlib.contextmanager
def rewind_generators(sampling: SamplingBatch, always: bool = False) -> Iterator[None]:
    """Set the seeded rows' generators back to their state at entry if the block raises (or always:
    a trial run), so a retried step draws the same noise as the step would have. An all-greedy
    batch draws nothing (and lists no generators)."""
    saved = [(generator, generator.get_state()) for generator in sampling.generators or [] if generator is not None]
    try:
        yield
    except BaseException:
        _restore(saved)
        raise
    if always:
        _restore(saved)


def _restore(saved: list) -> None:
    for generator, state in saved:
        generator.set_state(state)
