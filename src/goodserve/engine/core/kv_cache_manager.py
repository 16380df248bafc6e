"""Every sequence's block tables, by sequence id, over the block pool: prefix-cache matching,
allocation for the tokens a step computes, registration of full blocks, freeing.

The tables live here, not on the sequences, so one owner decides which blocks a request holds: the
scheduler asks for room, the runner receives copies of the tables in the scheduler's output, and
handing a request's blocks to another worker (disaggregation) is a question for this class alone.

The pool's layers come in groups (engine/setup/kv_groups.py: one for most models, one per kind of layer
and S layers for a hybrid one), each with its own blocks. A sequence's table interleaves them: entry
i * G + g is group g's block of the sequence's tokens [i * block_size, (i + 1) * block_size). A group
whose layers have a sliding window W reads, for a query at position p, keys after p - W only, so as
the sequence grows its blocks wholly before its next query's window are released: a long sequence
holds about W / block_size blocks of it, not its whole length. They go back to the pool as any freed
block does, registered ones (full, their K/V all written) staying in the prefix cache, where a later
request with the same prefix may revive them. Their ids stay in the table (the tables' indices are
positions); the kernels never read them, the torch paths read and mask them. A prefix-cache hit needs
of a windowed group only the blocks its next query reads: the entries before are placeholders (block
0), as unread as released ones.
"""

from __future__ import annotations

from goodserve.engine.core.block_pool import BlockPool, PrefixCacheCounters, chain_hash
from goodserve.engine.core.sequence import Sequence


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 salt: bytes = b"", windows: tuple[int | None, ...] = (None,)) -> None:
        """windows: each layer group's sliding window (KVGroups.windows; None: the group keeps every block)."""
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.windows = windows
        self.num_groups = len(windows)
        self._num_dropped: dict[str, list[int]] = {}  # per group, leading blocks released as out of its window
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt
        self.tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # chained hashes of a sequence's full blocks, memoized
        self._num_registered: dict[str, int] = {}  # leading blocks already offered to the prefix cache
        # Prefilled here, decoded elsewhere: the blocks a sequence held when it finished and the tokens
        # whose K/V they hold, kept until they are sent (engine/disagg/kv_transfer.py) and released.
        self.held: dict[str, tuple[list[int], int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def counters(self) -> PrefixCacheCounters:
        return self.pool.counters

    def block_table(self, seq_id: str) -> list[int]:
        return self.tables.get(seq_id, [])

    def blocks_held(self, seq_id: str) -> list[int]:
        """The blocks the sequence holds (its table less those released as out of their window)."""
        dropped = self._num_dropped.get(seq_id, [0] * self.num_groups)
        return [block_id for i, block_id in enumerate(self.tables.get(seq_id, []))
                if i // self.num_groups >= dropped[i % self.num_groups]]

    def _num_token_blocks(self, seq_id: str) -> int:
        """How many blocks of tokens the table covers (each with a block per group)."""
        return len(self.tables.get(seq_id, ())) // self.num_groups

    # ---- prefix cache --------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Attach the cached blocks that hold a prefix of seq's tokens; the tokens they cover. A group
        with a window needs only the blocks its next query reads (those before were released by the
        sequences that computed them, and may be gone); its table's earlier entries are placeholders,
        counted as released. A sequence held for a transfer takes every group's every block.

        At least the last token is always left to compute: its logits are what we sample from.
        A sequence that wants prompt logprobs or mean pooling computes every token (cached blocks keep
        no logits or hidden states).
        """
        assert not self.tables.get(seq.seq_id), "match_prefix on a sequence that holds blocks"
        table = self.tables[seq.seq_id] = []
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs or seq.params.pooling == "mean":
            return 0
        self.pool.counters.queries += seq.num_tokens
        size = self.block_size
        found = [[self.pool.cached_block(_group_hash(block_hash, g), tuple(seq.token_ids[i * size : (i + 1) * size]))
                  for g in range(self.num_groups)]
                 for i, block_hash in enumerate(self._block_hashes(seq, (seq.num_tokens - 1) // size))]
        keeps_all = seq.seq_id in self.held
        num_hit = self._longest_hit(found, keeps_all)
        dropped = self._num_dropped[seq.seq_id] = [self._first_read(g, num_hit * size, keeps_all)
                                                   for g in range(self.num_groups)]
        for i, blocks in enumerate(found[:num_hit]):
            for g, block_id in enumerate(blocks):
                if i >= dropped[g]:
                    self.pool.take(block_id)
                table.append(block_id if i >= dropped[g] else 0)  # 0: a placeholder, never read unmasked
        self._num_registered[seq.seq_id] = num_hit
        self.pool.counters.hits += num_hit * size
        return num_hit * size

    def _first_read(self, group: int, next_position: int, keeps_all: bool = False) -> int:
        """The first block of tokens a group's query at next_position reads (0 without a window)."""
        window = self.windows[group]
        if window is None or keeps_all:
            return 0
        return max(next_position - window + 1, 0) // self.block_size

    def _longest_hit(self, found: list[list[int | None]], keeps_all: bool) -> int:
        """The most leading blocks of tokens, k, whose blocks a query at k * block_size reads are all
        cached (found[i][g]: group g's block of the i-th, None where not cached)."""
        last_miss = [[-1] * (len(found) + 1) for _ in range(self.num_groups)]  # [g][k]: last miss before k
        for g, misses in enumerate(last_miss):
            for i, blocks in enumerate(found):
                misses[i + 1] = i if blocks[g] is None else misses[i]
        return next(k for k in range(len(found), -1, -1)
                    if all(misses[k] < self._first_read(g, k * self.block_size, keeps_all)
                           for g, misses in enumerate(last_miss)))

    def register_full_blocks(self, seq: Sequence) -> None:
        """Hash the blocks that became full (their K/V all written) so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        size, table, groups = self.block_size, self.tables[seq.seq_id], self.num_groups
        # A speculating sequence's kept drafts are computed before they are appended (Scheduler.advance):
        # a block is registered once its tokens are there too.
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // size
        hashes = self._block_hashes(seq, num_full)
        dropped = self._num_dropped.get(seq.seq_id, [0] * groups)
        for i in range(self._num_registered.get(seq.seq_id, 0), num_full):
            tokens = tuple(seq.token_ids[i * size : (i + 1) * size])
            for g in range(groups):
                if i >= dropped[g]:  # a released block may hold another sequence's K/V by now
                    self.pool.register(table[i * groups + g], _group_hash(hashes[i], g), tokens)
        self._num_registered[seq.seq_id] = num_full

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        hashes = self._hashes.setdefault(seq.seq_id, [])
        while len(hashes) < num_blocks:
            i = len(hashes)
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            hashes.append(chain_hash(hashes[-1] if i else None, tokens, self.salt))
        return hashes

    # ---- allocation ----------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, needed - self._num_token_blocks(seq.seq_id)) * self.num_groups

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give seq enough blocks for num_new_tokens more tokens; False (and no change) if short.
        With a window, first release the blocks its next query no longer sees."""
        self._drop_out_of_window(seq)
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.pool.num_free_blocks:
            return False
        table = self.tables.setdefault(seq.seq_id, [])
        for _ in range(needed):
            table.append(self.pool.take_free())
        return True

    def _drop_out_of_window(self, seq: Sequence) -> None:
        """The next query sits at num_computed_tokens and reads keys after it minus the window; every
        later query sits further on, so a block before that stays unread for good. A sequence held for
        a transfer keeps its blocks: the receiver gets (and may cache) all of its K/V."""
        if seq.seq_id in self.held or seq.seq_id not in self.tables:
            return
        table, groups = self.tables[seq.seq_id], self.num_groups
        dropped = self._num_dropped.setdefault(seq.seq_id, [0] * groups)
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            oldest_key = seq.num_computed_tokens - window + 1
            unread = min(max(oldest_key, 0) // self.block_size, len(table) // groups)
            for i in range(dropped[g], unread):
                self.pool.release(table[i * groups + g])
            dropped[g] = max(dropped[g], unread)

    def free_tail(self, seq: Sequence) -> None:
        """Release the blocks past seq's computed tokens: those only rejected drafts wrote (never out of
        a window: those lie before the computed tokens)."""
        table = self.tables[seq.seq_id]
        while self._num_token_blocks(seq.seq_id) * self.block_size >= seq.num_computed_tokens + self.block_size:
            for _ in range(self.num_groups):
                self.pool.release(table.pop())

    def free(self, seq: Sequence, finished: bool = False) -> None:
        """Release seq's blocks (preempted: it recomputes later; finished: its hashes go too, and a
        held sequence's blocks wait for release_held). Tail blocks are freed first so they are also
        evicted first: a shared prefix outlives them."""
        table = self.blocks_held(seq.seq_id)
        self.tables.pop(seq.seq_id, None)
        self._num_dropped.pop(seq.seq_id, None)
        self._num_registered.pop(seq.seq_id, None)
        if finished:
            self._hashes.pop(seq.seq_id, None)
            if seq.seq_id in self.held:
                self.held[seq.seq_id] = (table, seq.num_computed_tokens)
                return
        for block_id in reversed(table):
            self.pool.release(block_id)

    def hold(self, seq_id: str) -> None:
        """Keep the sequence's blocks past its finish, for a transfer."""
        self.held[seq_id] = ([], 0)

    def release_held(self, seq_id: str) -> None:
        for block_id in reversed(self.held.pop(seq_id, ([], 0))[0]):
            self.pool.release(block_id)


def _group_hash(block_hash: bytes, group: int) -> bytes:
    """The prefix cache's key of one group's block of these tokens (each group's holds other layers)."""
    return block_hash + group.to_bytes(2, "little")
