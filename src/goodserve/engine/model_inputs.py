"""A step's inputs on their way to the device: the scheduler's rows flattened to token-level lists
(FlatBatch), then tensors (ModelInput); and what the forward hands back (ModelOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from goodserve.engine.scheduler_output import SchedulerOutput
from goodserve.engine.spec_decode.drafts import Branch
from goodserve.ops.attention import AttentionMetadata
from goodserve.ops.tree_attention import tree_depths
from goodserve.sampling_params import SamplingParams


@dataclass
class RequestState:
    """What the runner keeps of a sequence for its whole life (engine/scheduler_output.NewRequestData)."""

    seq_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    wants_prompt_logprobs: bool
    generator: torch.Generator | None  # per-request seed: reproducible whatever the batch


@dataclass
class FlatBatch:
    """A scheduled batch flattened on the host: the token-level lists every input is built from."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]  # index into batch.seqs of the sequences that sample a token this step
    logits_indices: list[int]  # their last token's row in the flat batch (their drafts' rows before it)
    prompt_logit_spans: dict[int, tuple[int, int]]  # batch row -> flat [start, end) wanting logits
    pooling_spans: dict[int, tuple[int, int]] = field(default_factory=dict)  # batch row -> flat rows to sum
    # Side branches (lookahead's guesses), their tokens after every row's own: per branch, (batch row,
    # first flat token, context length, parents); and the flat tokens whose greedy token is returned.
    branches: list[tuple[int, int, int, list[int]]] = field(default_factory=list)
    branch_logit_rows: list[int] = field(default_factory=list)

    @property
    def num_own_tokens(self) -> int:
        """The rows' own tokens: those before the branches."""
        return self.branches[0][1] if self.branches else len(self.input_ids)


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: list[int]
    # [flat logits rows]: 1 + k per sampled row verifying k drafts; None when a decode graph replays
    # (one per row, in order)
    logits_indices: torch.Tensor | None
    prompt_logit_spans: dict[int, tuple[int, int]]
    graph: object | None = None  # the captured graph (engine/cuda_graphs.py) whose input buffer holds the batch
    pooling_spans: dict[int, tuple[int, int]] = field(default_factory=dict)
    branch_logit_rows: list[int] = field(default_factory=list)


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [len(sample_rows), V] float32
    prompt_logits: dict[int, torch.Tensor]  # batch row -> [n, V] float32
    logits_argmax: torch.Tensor | None = None  # [len(sample_rows)]: argmax(logits), when a graph computed it
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)  # batch row -> [hidden] float32 sum
    branch_argmax: torch.Tensor | None = None  # [len(branch_logit_rows)]: the greedy token after each



def flatten(out: SchedulerOutput, requests: dict[str, RequestState], block_size: int) -> FlatBatch:
    flat = FlatBatch([], [], [], [], [], [], [], [], {})
    for row, (seq_id, start, num_new) in enumerate(zip(out.seq_ids, out.num_computed_tokens, out.num_new_tokens)):
        end, table, offset = start + num_new, out.block_tables[row], len(flat.input_ids)
        state = requests[seq_id]
        # An ahead row's input is the previous step's token, still on the device: the runner copies it in.
        flat.input_ids.extend(out.token_ids[row] if row >= out.num_ahead else [0])
        flat.positions.extend(range(start, end))
        flat.slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        flat.query_lens.append(num_new)
        flat.seq_lens.append(end)
        flat.block_tables.append(table)
        num_prompt = len(state.prompt_token_ids)
        if state.wants_prompt_logprobs and start < num_prompt - 1:
            flat.prompt_logit_spans[row] = (offset, offset + min(end, num_prompt - 1) - start)
        pooling = state.params.pooling
        if pooling == "mean":
            flat.pooling_spans[row] = (offset, offset + num_new)
        elif pooling == "last" and end == num_prompt:
            flat.pooling_spans[row] = (offset + num_new - 1, offset + num_new)
        if out.samples[row]:  # a row with k drafts samples at its last 1 + k positions
            flat.sample_rows.append(row)
            flat.logits_indices.extend(range(offset + num_new - 1 - len(out.draft_token_ids.get(row, ())),
                                             offset + num_new))
    for row, branch in out.branches.items():
        _add_branch(flat, row, branch, out, block_size)
    return flat


# A row of up to this many tokens may go as one-token rows over its block table: a decode step for
# the attention, since every layer writes the step's K/V before any row attends (each row's context
# then ends at its own token). Verify rows (a token and its drafts) so take the CPU's native decode
# stack, and each row's arithmetic is a plain decode step's.
MAX_SPLIT_TOKENS = 8


def as_one_token_rows(flat: FlatBatch) -> FlatBatch:
    """The batch with every row of 2..MAX_SPLIT_TOKENS tokens laid out as one-token rows (the flat
    token lists, logits rows and spans are the same); unchanged where a row is longer or side
    branches hang off the rows (their tree attention needs the rows as they are)."""
    if flat.branches or max(flat.query_lens) == 1 or max(flat.query_lens) > MAX_SPLIT_TOKENS:
        return flat
    tables = [table for table, n in zip(flat.block_tables, flat.query_lens) for _ in range(n)]
    seq_lens = [end - n + 1 + i for end, n in zip(flat.seq_lens, flat.query_lens) for i in range(n)]
    return replace(flat, query_lens=[1] * len(seq_lens), seq_lens=seq_lens, block_tables=tables)


def _add_branch(flat: FlatBatch, row: int, branch: Branch, out: SchedulerOutput, block_size: int) -> None:
    """A branch's tokens after everything before them, hung after the row's last own token (its drafts
    are not in its context); slot -1: nothing of theirs is cached."""
    context_len = out.num_computed_tokens[row] + out.num_new_tokens[row] - len(out.draft_token_ids.get(row, ()))
    first = len(flat.input_ids)
    flat.branches.append((row, first, context_len, branch.parents))
    flat.input_ids.extend(branch.token_ids)
    flat.positions.extend(context_len - 1 + depth for depth in tree_depths(branch.parents))
    flat.slots.extend([-1] * len(branch.token_ids))
    flat.branch_logit_rows.extend(first + i for i in branch.logit_rows)


def pooled_sums(hidden: torch.Tensor, spans: dict[int, tuple[int, int]]) -> dict[int, torch.Tensor]:
    """Per pooling row, the float32 sum of its final hidden states in this step (one row for 'last')."""
    return {row: hidden[start:end].float().sum(dim=0) for row, (start, end) in spans.items()}


def leading_decodes(query_lens: list[int]) -> int:
    """How many sequences at the head of the batch compute one token each."""
    return next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
