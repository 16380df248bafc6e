"""What a step gives back to the engine: plain host data (ModelRunnerOutput), delivered through a
PendingOutput, since with async scheduling the engine launches the next step before reading it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from goodserve.engine.seam.drafts import BranchOutput

if TYPE_CHECKING:  # the scheduler reads this module's data without torch (tests/unit/test_layering.py)
    import torch


@dataclass
class ModelRunnerOutput:
    sample_rows: list[int]  # the scheduler output's rows that sampled, in the order of token_ids
    # Per sampled row, its new tokens: one, or for a row verifying drafts the drafts it kept and the
    # target's token after them (engine/spec_decode/acceptance.py).
    token_ids: list[list[int]]
    # index into token_ids -> per new token: (logprobs of the token then the top ones, their ids, its rank)
    logprobs: dict[int, list[tuple[list[float], list[int], int]]] = field(default_factory=dict)
    # row -> (index of the first prompt token predicted, values, ids, ranks): one entry per position
    prompt_logprobs: dict[int, tuple[int, list, list, list]] = field(default_factory=dict)
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> float32 hidden-state sum, on the host
    # seconds: building inputs, the forward (launch, and waiting for the device), sampling, the
    # drafter's proposals for the next step
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    propose_s: float = 0.0
    branches: dict[int, BranchOutput] = field(default_factory=dict)  # row -> its branch's results
    # row -> the drafts the runner's drafter (a draft model) proposed after this step for the row's
    # next one, as many as SchedulerOutput.num_next_drafts asked or fewer; the scheduler reads them
    # next step (their distributions stay with the drafter, which the verifier asks)
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    context_parallel: bool = False  # the step's tokens were split over the context-parallel ranks


class PendingOutput:
    """A launched step's output; result() waits for it (once) and returns it."""

    def __init__(self, fetch: Callable[[], ModelRunnerOutput], replayed_graph: bool) -> None:
        self._fetch = fetch
        self._output: ModelRunnerOutput | None = None
        self.replayed_graph = replayed_graph  # only such steps may run ahead of their tokens

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._fetch()
        return self._output
