"""Context parallelism's one collective a layer: each rank has written the K/V of its share of the
step's tokens into its cache; after `KVExchange.share` every rank's cache holds the K/V of all the
step's tokens, so each rank's queries attend the whole causal context (and decode later goes on
from a whole cache on every rank).

The rows travel as the cache stores them (after RoPE, quantized for an int8 / fp8 cache, with their
scales), so the exchange needs nothing of the layer's arithmetic. One all-gather of K and V side by
side (and one of their scales), each rank's rows padded to the longest share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class KVExchange:
    mine: torch.Tensor  # [my tokens] int64: the slots this rank wrote
    everyone: torch.Tensor  # [step tokens] int64: every rank's slots, rank after rank
    gathered_rows: torch.Tensor  # [step tokens] int64: their rows in the gathered [size * longest] rows
    longest: int  # the largest share, in tokens
    size: int
    group: dist.ProcessGroup | None = None

    @classmethod
    def of(cls, shares: list[list[int]], rank: int, device: torch.device,
           group: dist.ProcessGroup | None = None) -> KVExchange:
        """shares: each rank's slots, the same list on every rank."""
        longest = max(map(len, shares))
        rows = [r * longest + i for r, share in enumerate(shares) for i in range(len(share))]
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
        return cls(as_tensor(shares[rank]), as_tensor([s for share in shares for s in share]), as_tensor(rows),
                   longest, len(shares), group)

    def share(self, cache) -> None:
        """Every rank's new K/V rows into this rank's cache (a ops.attention.LayerKVCache)."""
        self._share_pools(cache.k, cache.v)
        if cache.k_scale is not None:
            self._share_pools(cache.k_scale, cache.v_scale)

    def _share_pools(self, k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
        # One-byte types (int8, fp8) travel and are copied as bytes: the collectives and some
        # indexing kernels take no float8.
        as_wire = (lambda x: x.view(torch.uint8)) if k_pool.element_size() == 1 else (lambda x: x)
        k_slots, v_slots = (as_wire(pool.view(k_pool.shape[0] * k_pool.shape[1], -1)) for pool in (k_pool, v_pool))
        width, count = k_slots.shape[1], len(self.mine)
        mine = k_slots.new_zeros((self.longest, 2 * width))
        mine[:count, :width] = k_slots.index_select(0, self.mine)
        mine[:count, width:] = v_slots.index_select(0, self.mine)
        gathered = mine.new_empty((self.size * self.longest, 2 * width))
        dist.all_gather_into_tensor(gathered, mine, group=self.group)
        rows = gathered.index_select(0, self.gathered_rows)
        k_slots.index_put_((self.everyone,), rows[:, :width])
        v_slots.index_put_((self.everyone,), rows[:, width:])
