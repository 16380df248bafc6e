"""A step's inputs on their way to the device: the scheduler's rows flattened to token-level lists
(FlatBatch), then tensors (ModelInput); and what the forward hands back (ModelOutput)."""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from goodserve.engine.seam.scheduler_output import SchedulerOutput
from goodserve.engine.seam.drafts import Branch
from goodserve.ops.attention import AttentionMetadata
from goodserve.ops.tree_attention import tree_depths
from goodserve.sampling_params import SamplingParams


@dataclass
class RequestState:
    """What the runner keeps of a sequence for its whole life (engine/seam/scheduler_output.NewRequestData)."""

    seq_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    wants_prompt_logprobs: bool
    generator: torch.Generator | None  # per-request seed: reproducible whatever the batch
    # Facts of the request read every step, found once: whether a step's flat batch marks spans of
    # its tokens (prompt logits, pooling), and whether its tokens are the logits' argmax whatever
    # its output so far (greedy, no bias, penalties or min_tokens), so sampling needs no settings.
    needs_spans: bool = field(init=False)
    argmax_only: bool = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.needs_spans = self.wants_prompt_logprobs or p.pooling is not None
        self.argmax_only = (p.greedy and p.repetition_penalty == 1.0 and not p.presence_penalty
                            and not p.frequency_penalty and not p.logit_bias and p.min_tokens == 0)


@dataclass
class FlatBatch:
    """A scheduled batch flattened on the host: the token-level lists every input is built from."""

    input_ids: list[int]
    positions: list[int]
    # Every token's K/V slot, group after group of a pool of several layer groups (engine/setup/kv_groups.py)
    slots: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]  # a row's groups' tables interleaved (engine/core/kv_cache_manager.py)
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
    graph: object | None = None  # the captured graph (engine/worker/cuda_graphs.py) whose input buffer holds the batch
    pooling_spans: dict[int, tuple[int, int]] = field(default_factory=dict)
    branch_logit_rows: list[int] = field(default_factory=list)
    # A step split by context parallelism (engine/worker/context_parallel.py): its logits rows, all rank 0's,
    # which it broadcasts
    shared_logit_rows: int | None = None


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [len(sample_rows), V] float32
    prompt_logits: dict[int, torch.Tensor]  # batch row -> [n, V] float32
    logits_argmax: torch.Tensor | None = None  # [len(sample_rows)]: argmax(logits), when a graph computed it
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)  # batch row -> [hidden] float32 sum
    branch_argmax: torch.Tensor | None = None  # [len(branch_logit_rows)]: the greedy token after each



def flatten(out: SchedulerOutput, requests: dict[str, RequestState], block_size: int,
            num_groups: int = 1) -> FlatBatch:
    """The batch's token-level lists, built a list at a time (comprehensions and itertools run in C:
    at hundreds of rows a loop over rows that appends to each list costs the host ~2 us a row)."""
    starts, num_new, tables = out.num_computed_tokens, out.num_new_tokens, out.block_tables
    ends = list(map(operator.add, starts, num_new))
    offsets = [0, *itertools.accumulate(num_new)]  # each row's first flat token, then the count
    # Decodes lead the batch: their one position each in one comprehension, then the longer rows.
    lead = leading_decodes(num_new)
    positions = starts[:lead] + list(itertools.chain.from_iterable(map(range, starts[lead:], ends[lead:])))
    # Per layer group (engine/setup/kv_groups.py), every token's slot: group 0's run of them, then group 1's, ...
    slots = []
    for group in range(num_groups):
        slots += [table[p // block_size * num_groups + group] * block_size + p % block_size
                  for table, p in zip(tables, starts[:lead])]
        for table, start, end in zip(tables[lead:], starts[lead:], ends[lead:]):
            slots += token_slots(table, start, end, block_size, num_groups, group)
    # An ahead row's input is the previous step's token, still on the device: the runner copies it in.
    input_ids = [0] * out.num_ahead + list(itertools.chain.from_iterable(out.token_ids[out.num_ahead:]))
    sample_rows = list(itertools.compress(range(len(starts)), out.samples))
    drafts = out.draft_token_ids
    if drafts:  # a row with k drafts samples at its last 1 + k positions
        logits_indices = [i for row in sample_rows
                          for i in range(offsets[row + 1] - 1 - len(drafts.get(row, ())), offsets[row + 1])]
    else:
        logits_indices = [offsets[row + 1] - 1 for row in sample_rows]
    flat = FlatBatch(input_ids, positions, slots, list(num_new), ends, list(tables), sample_rows, logits_indices, {})
    states = [requests[seq_id] for seq_id in out.seq_ids]
    for row in (row for row, state in enumerate(states) if state.needs_spans):
        _add_spans(flat, row, states[row], starts[row], ends[row], offsets[row])
    for row, branch in out.branches.items():
        _add_branch(flat, row, branch, out, block_size)
    return flat


def token_slots(table: list[int], start: int, end: int, block_size: int, num_groups: int = 1,
                group: int = 0) -> list[int]:
    """One layer group's K/V slots of positions [start, end) of a row with this table (its groups'
    tables interleaved: engine/core/kv_cache_manager.py); a long row (a prompt chunk) in numpy, ~10x
    faster a token than Python."""
    if end - start <= 16:
        return [table[p // block_size * num_groups + group] * block_size + p % block_size for p in range(start, end)]
    positions = np.arange(start, end)
    blocks = np.array(table)[positions // block_size * num_groups + group]
    return (blocks * block_size + positions % block_size).tolist()


def _add_spans(flat: FlatBatch, row: int, state: RequestState, start: int, end: int, offset: int) -> None:
    """The row's prompt-logits span (prompt logprobs) and pooling span, where its request asks for them."""
    num_prompt = len(state.prompt_token_ids)
    if state.wants_prompt_logprobs and start < num_prompt - 1:
        flat.prompt_logit_spans[row] = (offset, offset + min(end, num_prompt - 1) - start)
    pooling = state.params.pooling
    if pooling == "mean":
        flat.pooling_spans[row] = (offset, offset + end - start)
    elif pooling == "last" and end == num_prompt:
        flat.pooling_spans[row] = (offset + end - start - 1, offset + end - start)


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
