"""One int32 layout for a step's inputs, shared by the eager path and both kinds of CUDA graph, so a
step's inputs reach the device in one host-to-device copy whichever runs it:

    [input_ids | positions | logits_indices | slot_mapping]   token rows, num_tokens entries each
    [seq_lens | query_start_loc]                              sequence rows, num_seqs + ALIGN_INT32 each
    [leading decodes]                                         ALIGN_INT32 entries, the first one used
    [block tables, column-major]                              max_blocks x num_seqs

A pool of G layer groups (engine/setup/kv_groups.py) has G slot_mapping rows, one per group, and tables
of G entries a block of tokens, the groups' interleaved (engine/core/kv_cache_manager.py): max_blocks
counts those entries.

logits_indices has a row per token: a sequence verifying k drafts has logits at its last 1 + k
tokens, so a step has up to num_tokens logits rows, whatever its sequence count.

Column-major tables put the columns a step uses first, so a copy covers only those; columns past
them keep valid block ids of earlier steps, which the kernels never read (seq_lens bound them).
Rows past the batch are padding: input id and position 0, slot -1 (no K/V write), length 0; the
padding tokens belong to the first padding sequence (query_start_loc runs on to num_tokens), so
their attention output is 0, not uninitialized memory.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from goodserve.engine.worker.model_inputs import FlatBatch, leading_decodes

# Every part starts 16-byte aligned: Triton specializes kernels on pointer alignment, so inputs at
# arbitrary offsets would compile new kernel variants (each hundreds of ms) in the middle of a run.
ALIGN_INT32 = 4
FEW_SEQUENCES = 32  # up to this many, block tables are written one at a time (_fill_tables)


@dataclass
class StepBuffers:
    """Views of one buffer in the layout, each as long as the layout holds."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor  # [G, num_tokens]: each group's slots
    logits_indices: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    leading_decodes: torch.Tensor  # [1]
    block_tables: torch.Tensor  # [num_seqs, max_blocks], column-major


def _aligned(n: int) -> int:
    return -(-n // ALIGN_INT32) * ALIGN_INT32


class InputLayout:
    def __init__(self, num_tokens: int, num_seqs: int, max_blocks: int, num_groups: int = 1) -> None:
        self.num_tokens, self.num_seqs, self.max_blocks = _aligned(num_tokens), _aligned(num_seqs), max_blocks
        self.token_rows = 3 + num_groups
        self.seq_rows = self.num_seqs + ALIGN_INT32  # room for query_start_loc's extra entry, aligned
        self.seqs_at = self.token_rows * self.num_tokens
        self.tables_at = self.seqs_at + 2 * self.seq_rows + ALIGN_INT32
        self.size = self.tables_at + max_blocks * self.num_seqs

    def used(self, flat: FlatBatch) -> int:
        """How many leading entries the batch fills: the table columns it uses, no more."""
        return self.tables_at + self.num_seqs * max(map(len, flat.block_tables))

    def views(self, buffer: torch.Tensor) -> StepBuffers:
        t, s = self.num_tokens, self.seq_rows
        tokens = buffer[: self.seqs_at].view(self.token_rows, t)
        input_ids, positions, logits_indices, slot_mapping = tokens[0], tokens[1], tokens[2], tokens[3:]
        seq_lens, query_start_loc = buffer[self.seqs_at : self.seqs_at + 2 * s].view(2, s)
        return StepBuffers(input_ids, positions, slot_mapping, logits_indices, seq_lens[: self.num_seqs],
                           query_start_loc[: self.num_seqs + 1], buffer[self.tables_at - ALIGN_INT32 :][:1],
                           buffer[self.tables_at : self.size].view(self.max_blocks, self.num_seqs).t())

    def pack(self, flat: FlatBatch, host: np.ndarray) -> None:
        """Write the batch into host (the layout's first `used(flat)` entries), padding included."""
        num_tokens, num_seqs = len(flat.input_ids), len(flat.seq_lens)
        tokens = host[: self.seqs_at].reshape(self.token_rows, self.num_tokens)
        for row, values in zip(tokens, (flat.input_ids, flat.positions)):
            row[:num_tokens] = values
            row[num_tokens:] = 0
        tokens[2, : len(flat.logits_indices)] = flat.logits_indices  # read up to their count only
        tokens[3:, :num_tokens].flat = flat.slots  # group after group
        tokens[3:, num_tokens:] = -1  # padding: no K/V write
        seq_lens, query_start_loc = host[self.seqs_at : self.seqs_at + 2 * self.seq_rows].reshape(2, self.seq_rows)
        seq_lens[:num_seqs] = flat.seq_lens
        seq_lens[num_seqs:] = 0
        query_start_loc[0] = 0
        query_start_loc[1 : num_seqs + 1] = np.cumsum(flat.query_lens)
        query_start_loc[num_seqs + 1 :] = self.num_tokens
        host[self.tables_at - ALIGN_INT32] = leading_decodes(flat.query_lens)
        tables = host[self.tables_at :].reshape(-1, self.num_seqs)
        tables[:] = 0
        _fill_tables(tables[:, :num_seqs], flat.block_tables)


def _fill_tables(columns: np.ndarray, block_tables: list[list[int]]) -> None:
    """Each sequence's table into the leading entries of its column. A table at a time costs ~0.6 us a
    sequence; gathering them into one array and one masked assignment costs ~3 us, then less a
    sequence: it pays from a few dozen sequences (benchmarks/cpu_runner_inputs.py)."""
    if len(block_tables) <= FEW_SEQUENCES:
        for seq, table in enumerate(block_tables):
            columns[: len(table), seq] = table
        return
    lengths = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    entries = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(lengths.sum()))
    columns.T[np.arange(columns.shape[0]) < lengths[:, None]] = entries
