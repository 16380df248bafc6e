"""Context parallelism: a long prompt's prefill split over N ranks (`--context-parallel-size N`),
each rank holding the whole model and a whole KV cache.

A step splits where one of its rows has at least 2N tokens (so every rank gets some) and it asks
for nothing the split does not carry (prompt logprobs, pooling, drafts to verify, side branches).
Each row of the step is cut into 2N chunks as even as possible and rank r computes chunks r and
2N - 1 - r (the zigzag split): a chunk's queries attend the chunks before it, so the pairs even out
the causal work. Rows shorter than 2N tokens (decodes) go to rank 0 whole. Every layer, each rank
writes its tokens' K/V and gathers the others' (ops/kv_exchange.py), then its queries attend the
whole context from its cache, each piece of a row as a sequence of its own, as a prefill chunk does.

Every row's last token is rank 0's (chunk 2N - 1), so rank 0 holds the hidden states to sample
from and broadcasts them; every rank samples the same logits and takes rank 0's tokens.

The KV of every step lands on every rank, so the steps that do not split (decodes) run whole on
each rank, exactly as on one, CUDA graphs and all, with no collective but the sampled tokens'
broadcast. That costs each rank the whole cache's memory (no more prompt room than one GPU holds);
in return decode needs nothing new and the pool, the prefix cache and the block tables are one
rank's. Keeping each rank's share instead (decode attention over the shards, merged by their
log-sum-exp) would divide the cache by N.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from goodserve.engine.worker.model_inputs import FlatBatch
from goodserve.ops.kv_exchange import KVExchange


@dataclass
class LocalShare:
    """A split step as this rank runs it."""

    flat: FlatBatch  # this rank's tokens, each piece of a row a sequence of its own
    kv_exchange: KVExchange
    num_logit_rows: int  # the step's logits rows (rank 0 holds them all)


@dataclass(frozen=True)
class ContextParallel:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None: the default group (every rank)

    def split(self, flat: FlatBatch, device: torch.device) -> LocalShare | None:
        """This rank's share of the step; None where the step runs whole on every rank."""
        if not self._splits(flat):
            return None
        pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(self.size)]  # per rank: (row, start, end)
        start = 0
        for row, n in enumerate(flat.query_lens):
            for rank, chunks in enumerate(zigzag(n, self.size)):
                pieces[rank].extend((row, start + s, start + e) for s, e in chunks)
            start += n
        slots = [[slot for _, s, e in share for slot in flat.slots[s:e]] for share in pieces]
        local = _local_batch(flat, pieces[self.rank], holds_logits=self.rank == 0)
        return LocalShare(local, KVExchange.of(slots, self.rank, device, self.group), len(flat.logits_indices))

    def _splits(self, flat: FlatBatch) -> bool:
        return (self.size > 1 and max(flat.query_lens) >= 2 * self.size and not flat.branches
                and not flat.prompt_logit_spans and not flat.pooling_spans
                and len(flat.logits_indices) == len(flat.sample_rows))  # no drafts to verify

    def from_first(self, rows: torch.Tensor, count: int) -> torch.Tensor:
        """Rank 0's rows [count, hidden] on every rank (the others pass any rows of the same width)."""
        if self.rank != 0:
            rows = rows.new_empty((count, rows.shape[1]))
        dist.broadcast(rows.contiguous(), src=self._first(), group=self.group)
        return rows

    def broadcast_from_first(self, x: torch.Tensor) -> None:
        if self.size > 1:
            dist.broadcast(x, src=self._first(), group=self.group)

    def _first(self) -> int:
        return 0 if self.group is None else dist.get_global_rank(self.group, 0)


def zigzag(n: int, size: int) -> list[list[tuple[int, int]]]:
    """Per rank, the [start, end) pieces of a row of n tokens it computes: chunks r and 2N - 1 - r of
    2N (one piece where they meet); a row shorter than 2N all to rank 0."""
    if n < 2 * size:
        return [[(0, n)]] + [[] for _ in range(size - 1)]
    bounds = [c * n // (2 * size) for c in range(2 * size + 1)]
    found = []
    for rank in range(size):
        last = 2 * size - 1 - rank
        if last == rank + 1:  # the middle pair meets
            found.append([(bounds[rank], bounds[last + 1])])
        else:
            found.append([(bounds[rank], bounds[rank + 1]), (bounds[last], bounds[last + 1])])
    return found


def _local_batch(flat: FlatBatch, pieces: list[tuple[int, int, int]], holds_logits: bool) -> FlatBatch:
    """The pieces as a batch: each a sequence whose context ends at its last token (the row's blocks)."""
    local = FlatBatch([], [], [], [], [], [], list(flat.sample_rows), [], {})
    row_ends = list(itertools.accumulate(flat.query_lens))
    local_start = {}  # piece (start, end) -> its first row in the local batch
    for row, start, end in pieces:
        local_start[start, end] = len(local.input_ids)
        local.input_ids.extend(flat.input_ids[start:end])
        local.positions.extend(flat.positions[start:end])
        local.slots.extend(flat.slots[start:end])
        local.query_lens.append(end - start)
        local.seq_lens.append(flat.seq_lens[row] - (row_ends[row] - end))
        local.block_tables.append(flat.block_tables[row])
    if holds_logits:
        local.logits_indices = [next(at + i - start for (start, end), at in local_start.items() if start <= i < end)
                                for i in flat.logits_indices]
    return local
