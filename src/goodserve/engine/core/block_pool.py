"""The paged KV cache's blocks: a fixed pool with reference counts, an LRU free list and the hash index
of the prefix cache.

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
    counters: PrefixCacheCounters = field(default_factory=PrefixCacheCounters)

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        # LRU order: the first entry is evicted first. Holds every block with ref_count 0.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(self.num_blocks))
        self.cached: dict[bytes, int] = {}  # hash -> block id of a full, registered block

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def cached_block(self, block_hash: bytes, token_ids: tuple[int, ...]) -> int | None:
        """The registered block holding exactly these tokens after this prefix, if any."""
        block_id = self.cached.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    def register(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """Offer a full block to the prefix cache. An identical block computed twice (two requests at
        once) keeps the first as the cached one."""
        block = self.blocks[block_id]
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash, block.token_ids = block_hash, token_ids
            self.cached[block_hash] = block_id

    def take(self, block_id: int) -> None:
        self.blocks[block_id].ref_count += 1
        self.free.pop(block_id, None)

    def take_free(self) -> int:
        """The least recently used free block, emptied of whatever prefix it cached."""
        block_id = next(iter(self.free))
        self._evict(block_id)
        self.take(block_id)
        return block_id

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash, block.token_ids = None, ()
