"""The draft model's paged KV cache bookkeeping: per sequence, a block table over a pool of its own and
the tokens whose K/V those blocks hold, in order.

Kept in step with the target by content, not by events: before each proposal the cache keeps the
longest prefix of what it holds that the sequence still has (after a verification: the drafts the
target accepted; the rejected ones, and the blocks only they used, go), so a rollback, a draft the
scheduler dropped, or a proposal the target never verified all come out right. No prefix sharing:
each sequence's draft K/V are its own (a draft's prompt costs one extra prefill of the draft).
"""

from __future__ import annotations

from goodserve.engine.core.block_pool import BlockPool


class DraftKV:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    def keep_common_prefix(self, seq_id: str, token_ids: list[int]) -> int:
        """Drop what seq_id's cache holds past its common prefix with token_ids, leaving at least the
        last token to compute (its logits propose the first draft); the tokens kept."""
        cached = self.tokens.setdefault(seq_id, [])
        n = min(len(cached), len(token_ids) - 1)
        if cached[:n] != token_ids[:n]:
            n = next(i for i, (a, b) in enumerate(zip(cached, token_ids)) if a != b)
        del cached[n:]
        table = self.tables.setdefault(seq_id, [])
        while len(table) * self.block_size >= n + self.block_size:
            self.pool.release(table.pop())
        return n

    def reserve(self, seq_id: str, num_tokens: int) -> bool:
        """Blocks for num_tokens tokens in all; False (and no change) when the pool is short."""
        table = self.tables.setdefault(seq_id, [])
        needed = -(-num_tokens // self.block_size) - len(table)
        if needed > self.pool.num_free_blocks:
            return False
        for _ in range(needed):
            table.append(self.pool.take_free())
        return True

    def slot(self, seq_id: str, position: int) -> int:
        return self.tables[seq_id][position // self.block_size] * self.block_size + position % self.block_size

    def release(self, seq_id: str) -> None:
        for block_id in reversed(self.tables.pop(seq_id, ())):
            self.pool.release(block_id)
        self.tokens.pop(seq_id, None)
