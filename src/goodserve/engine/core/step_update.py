"""How a computed step's tokens end sequences, as plain data: the scheduler appends each sampled
row's kept tokens and ends a sequence at a stop token or its length (Scheduler.update_from_output);
the output processor then detokenizes what was appended, and ends a sequence at a stop string or a
grammar's end (OutputProcessor.process). Neither calls the other: each returns what it did."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from goodserve.engine.core.sequence import Sequence
from goodserve.engine.seam.scheduler_output import SchedulerOutput

if TYPE_CHECKING:  # the runner's output module imports torch; the scheduler needs none
    from goodserve.engine.seam.runner_output import ModelRunnerOutput


@dataclass
class Finish:
    reason: str  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None


@dataclass
class StepUpdate:
    """What Scheduler.update_from_output did to the step's sequences."""

    # per sampled row that got tokens: (its index in the runner output's token_ids, the sequence,
    # how many tokens it appended: its last ones)
    appended: list[tuple[int, Sequence, int]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # ended this step (their finish_reason set)


def append_tokens(seq: Sequence, tokens: list[int], eos_token_ids: list[int]) -> tuple[int, Finish | None]:
    """Append a row's kept tokens to seq, up to the first that ends it: a stop token (once min_tokens
    are out; eos unless ignore_eos) or its length. Returns how many it appended, and how it ends."""
    params = seq.params
    for count, token in enumerate(tokens, 1):
        seq.token_ids.append(token)
        if seq.num_output_tokens >= params.min_tokens and (
                token in params.stop_token_ids or (token in eos_token_ids and not params.ignore_eos)):
            return count, Finish("stop", token if token in params.stop_token_ids else None)
        if seq.num_output_tokens >= (params.max_tokens or seq.max_len) or seq.num_tokens >= seq.max_len:
            return count, Finish("length")
    return len(tokens), None


def rejected_per_row(out: SchedulerOutput, output: ModelRunnerOutput) -> dict[int, int]:
    """Per row that verified drafts, how many the runner rejected (it keeps the rest and adds one)."""
    return {row: len(out.draft_token_ids[row]) + 1 - len(tokens)
            for row, tokens in zip(output.sample_rows, output.token_ids) if row in out.draft_token_ids}
