"""The zigzag split of a step's rows over context-parallel ranks, against a direct count: every
token computed by exactly one rank, each piece a sequence whose context ends at its own last token,
every row's last token (the one sampled from) on rank 0, the causal work even across the ranks."""

from __future__ import annotations

import pytest
import torch

from goodserve.engine.worker.context_parallel import ContextParallel, zigzag
from goodserve.engine.worker.model_inputs import FlatBatch

BLOCK = 4


def batch(rows: list[tuple[int, int]]) -> FlatBatch:
    """rows: (tokens cached before this step, tokens this step); each row's blocks its own."""
    flat = FlatBatch([], [], [], [], [], [], [], [], {})
    for row, (cached, new) in enumerate(rows):
        table = [100 * (row + 1) + b for b in range(-(-(cached + new) // BLOCK))]
        flat.input_ids.extend(1000 * row + p for p in range(cached, cached + new))
        flat.positions.extend(range(cached, cached + new))
        flat.slots.extend(table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, cached + new))
        flat.query_lens.append(new)
        flat.seq_lens.append(cached + new)
        flat.block_tables.append(table)
        flat.sample_rows.append(row)
        flat.logits_indices.append(len(flat.input_ids) - 1)
    return flat


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("rows", [[(0, 97)], [(0, 1), (5, 1), (0, 64), (16, 33), (0, 3)]])
def test_every_token_once_with_its_own_context_and_the_sampled_ones_on_rank_0(size, rows):
    flat = batch(rows)
    shares = [ContextParallel(rank, size).split(flat, torch.device("cpu")) for rank in range(size)]
    computed = sorted(t for share in shares for t in share.flat.input_ids)
    assert computed == sorted(flat.input_ids)
    for share in shares:
        local, at = share.flat, 0
        for n, seq_len, table in zip(local.query_lens, local.seq_lens, local.block_tables):
            positions = local.positions[at : at + n]
            assert positions == list(range(seq_len - n, seq_len))  # a piece attends up to its last token
            row = local.input_ids[at] // 1000
            assert table == flat.block_tables[row]
            assert local.slots[at : at + n] == [table[p // BLOCK] * BLOCK + p % BLOCK for p in positions]
            at += n
        assert share.kv_exchange.mine.tolist() == local.slots
        assert sorted(share.kv_exchange.everyone.tolist()) == sorted(flat.slots)
        assert local.sample_rows == flat.sample_rows and share.num_logit_rows == len(rows)
    rank_0 = shares[0].flat
    assert [rank_0.input_ids[i] for i in rank_0.logits_indices] == [flat.input_ids[i] for i in flat.logits_indices]
    assert all(not share.flat.logits_indices for share in shares[1:])


def test_zigzag_evens_out_the_causal_work():
    """Query at position p attends p + 1 keys: the ranks' sums differ by a few rows' worth, where a
    plain cut into N contiguous parts gives the last rank about 2N - 1 times the first's."""
    n, size = 4096, 4
    work = [sum(p + 1 for s, e in pieces for p in range(s, e)) for pieces in zigzag(n, size)]
    assert max(work) - min(work) <= 2 * n
    contiguous = [sum(p + 1 for p in range(r * n // size, (r + 1) * n // size)) for r in range(size)]
    assert contiguous[-1] > 6 * contiguous[0]


def test_steps_that_ask_for_what_the_split_does_not_carry_run_whole():
    cp = ContextParallel(0, 2)
    assert cp.split(batch([(0, 3), (7, 1)]), torch.device("cpu")) is None  # no row of 2N tokens
    for field, value in (("prompt_logit_spans", {0: (0, 9)}), ("pooling_spans", {0: (0, 10)}),
                         ("logits_indices", [8, 9])):  # a row verifying a draft
        flat = batch([(0, 10)])
        setattr(flat, field, value)
        assert cp.split(flat, torch.device("cpu")) is None
