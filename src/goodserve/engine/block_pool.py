"""The paged KV cache's bookkeeping: a fixed pool of blocks, reference counts and the prefix cache.

A full block is identified by a chained hash of its token ids (and the hash of every block before
it, and a salt for whatever else changes the K/V, such as the model revision), so a block can be
shared by every sequence whose prefix is identical. Blocks nobody references stay in an LRU free
list with their contents intact: a later request can revive them until they are reused.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from goodserve.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()  # kept so a hash hit is verified, never trusted blindly


@dataclass
class PrefixCacheCounters:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found


def chain_hash(parent: bytes | None, token_ids: list[int], salt: bytes) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(salt)
    digest.update(parent or b"root")
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return digest.digest()


@dataclass
class BlockPool:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    salt: bytes = b""
    counters: PrefixCacheCounters = field(default_factory=PrefixCacheCounters)

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        # LRU order: the first entry is evicted first. Holds every block with ref_count 0.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(self.num_blocks))
        self.cached: dict[bytes, int] = {}  # hash -> block id of a full, registered block

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, needed - len(seq.block_table))

    # ---- prefix cache --------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> None:
        """Attach the cached blocks that hold a prefix of seq's tokens; sets num_computed_tokens.

        At least the last token is always left to compute: its logits are what we sample from.
        A sequence that wants prompt logprobs or mean pooling computes every token (cached blocks keep
        no logits or hidden states).
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs or seq.params.pooling == "mean":
            return
        self.counters.queries += seq.num_tokens
        for i, block_hash in enumerate(self._block_hashes(seq, (seq.num_tokens - 1) // self.block_size)):
            block_id = self.cached.get(block_hash)
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            self._take(block_id)
            seq.block_table.append(block_id)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        seq.num_registered_blocks = len(seq.block_table)
        self.counters.hits += seq.num_computed_tokens

    def register_full_blocks(self, seq: Sequence) -> None:
        """Hash the blocks that became full (their K/V all written) so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        hashes = self._block_hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            # An identical block computed twice (two requests at once) keeps the first as the cached one.
            if block.block_hash is None and hashes[i] not in self.cached:
                block.block_hash = hashes[i]
                block.token_ids = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
                self.cached[hashes[i]] = block.block_id
        seq.num_registered_blocks = num_full

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Chained hashes of seq's first num_blocks full blocks, memoized on the sequence."""
        while len(seq.block_hashes) < num_blocks:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else None
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            seq.block_hashes.append(chain_hash(parent, tokens, self.salt))
        return seq.block_hashes

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give seq enough blocks for num_new_tokens more tokens; False (and no change) if short."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self.free):
            return False
        for _ in range(needed):
            block_id = next(iter(self.free))
            self._evict(block_id)
            self._take(block_id)
            seq.block_table.append(block_id)
        return True

    def free_sequence(self, seq: Sequence) -> None:
        # Tail blocks are freed first so they are also evicted first: a shared prefix outlives them.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def _take(self, block_id: int) -> None:
        self.blocks[block_id].ref_count += 1
        self.free.pop(block_id, None)

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash, block.token_ids = None, ()

    def reset_prefix_cache(self) -> None:
        for block_id in list(self.free):
            self._evict(block_id)
