"""What the scheduler hands the model runner each step: plain data only (ids, ints, lists), so it can
cross a process boundary (pickled to a worker) and be cut into sub-batches to isolate a culprit.

Rows are sequences, decodes first (the attention kernels take a batch's leading one-token rows
apart; a decode verifying k drafts is a row of 1 + k tokens). With async scheduling the first `num_ahead` rows decode a token the step in flight is still
sampling: their input is that step's token, which the runner keeps on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from goodserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # the bench and the router import this module and never torch (tests/unit/test_layering.py)
    from goodserve.engine.seam.drafts import Branch


@dataclass
class NewRequestData:
    """A sequence the runner has not seen: what sampling needs for its whole life."""

    seq_id: str
    params: SamplingParams
    index: int  # which of its request's n samples (a seed draws seed + index)
    prompt_token_ids: list[int]


@dataclass
class SchedulerOutput:
    seq_ids: list[str] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # the row's first position this step
    token_ids: list[list[int]] = field(default_factory=list)  # the tokens to compute; [] for ahead rows
    block_tables: list[list[int]] = field(default_factory=list)  # the row's whole table (a copy)
    samples: list[bool] = field(default_factory=list)  # whether the row samples a token this step
    num_output_tokens: list[int] = field(default_factory=list)  # generated so far (min_tokens bans)
    # row -> its generated tokens, for the rows whose penalties count them
    penalty_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # row -> the drafts it verifies (the last of its token_ids; engine/spec_decode/acceptance.py).
    # Those a draft model sampled are verified by the rejection rule (engine/spec_decode/rejection.py)
    # with the distributions the runner's drafter kept (engine/worker/drafter.py).
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # row -> how many drafts to propose after this step for its next one (the speculator's plan,
    # engine/spec_decode/policy.py): a drafter in the runner proposes them (ModelRunnerOutput.spec_token_ids)
    num_next_drafts: dict[int, int] = field(default_factory=dict)
    # row -> tokens computed after its last own token and never cached (lookahead's guesses)
    branches: dict[int, Branch] = field(default_factory=dict)
    num_ahead: int = 0
    # Set by the engine: runner-side state to create and to drop (both idempotent, so a retried
    # or sub-batched step may carry them again).
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_seq_ids: list[str] = field(default_factory=list)
    # Sequences preempted while this step was decided: the runner's drafter drops their draft K/V.
    preempted_seq_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def all_sample(self) -> bool:
        return all(self.samples)

    def __len__(self) -> int:
        return len(self.seq_ids)

    def select(self, rows: list[int]) -> SchedulerOutput:
        """These rows, in their order (decodes still lead), as a step of their own."""
        assert self.num_ahead == 0, "only a synchronous step is cut into parts"
        kept = {row: i for i, row in enumerate(rows)}
        return SchedulerOutput(
            seq_ids=[self.seq_ids[r] for r in rows], num_new_tokens=[self.num_new_tokens[r] for r in rows],
            num_computed_tokens=[self.num_computed_tokens[r] for r in rows],
            token_ids=[self.token_ids[r] for r in rows], block_tables=[self.block_tables[r] for r in rows],
            samples=[self.samples[r] for r in rows], num_output_tokens=[self.num_output_tokens[r] for r in rows],
            penalty_token_ids={kept[r]: ids for r, ids in self.penalty_token_ids.items() if r in kept},
            draft_token_ids={kept[r]: ids for r, ids in self.draft_token_ids.items() if r in kept},
            num_next_drafts={kept[r]: k for r, k in self.num_next_drafts.items() if r in kept},
            branches={kept[r]: branch for r, branch in self.branches.items() if r in kept},
            new_requests=self.new_requests, finished_seq_ids=self.finished_seq_ids,
            preempted_seq_ids=self.preempted_seq_ids)
