"""Seeded random add / abort / finish / preempt traffic over the scheduler and block pool.

A shadow copy of the cache records which token each slot's K/V was computed for; after every step
each live sequence's computed positions must read back its own tokens, so a prefix-cache hit that
served a block holding other tokens cannot go unnoticed.
"""

import random

import pytest

from goodserve.config import EngineConfig
from goodserve.engine.block_pool import BlockPool
from goodserve.engine.scheduler import Scheduler
from goodserve.engine.sequence import Sequence, SequenceStatus
from goodserve.sampling_params import SamplingParams

BLOCK = 4


def make_seq(rng: random.Random, i: int, prefixes: list[list[int]]) -> Sequence:
    prompt = list(rng.choice(prefixes)) + [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
    max_new = rng.randrange(1, 24)
    return Sequence(seq_id=f"s{i}", request_id=f"s{i}", index=0, token_ids=prompt,
                    num_prompt_tokens=len(prompt), params=SamplingParams(max_tokens=max_new),
                    max_len=len(prompt) + max_new, arrival_time=float(i))


def check_invariants(pool: BlockPool, live: list[Sequence], shadow: dict[int, list]) -> None:
    refs = [0] * pool.num_blocks
    for seq in live:
        for block_id in seq.block_table:
            refs[block_id] += 1
        for pos in range(seq.num_computed_tokens):
            block_id = seq.block_table[pos // BLOCK]
            assert shadow[block_id][pos % BLOCK] == seq.token_ids[pos], "served a block with other tokens"
    for block in pool.blocks:
        assert block.ref_count == refs[block.block_id] >= 0
        assert (block.ref_count == 0) == (block.block_id in pool.free)
    for block_hash, block_id in pool.cached.items():
        assert pool.blocks[block_id].block_hash == block_hash


@pytest.mark.parametrize("policy,chunked", [("continuous", True), ("continuous", False), ("static", True),
                                            ("makespan", True)])
def test_random_traffic_leaks_nothing(policy, chunked):
    rng = random.Random(1234)
    config = EngineConfig(scheduler_policy=policy, max_num_seqs=6, max_num_batched_tokens=24,
                          enable_chunked_prefill=chunked, block_size=BLOCK)
    if not chunked:
        config.max_num_batched_tokens = 64
    pool = BlockPool(num_blocks=14, block_size=BLOCK)
    scheduler = Scheduler(config, pool)
    prefixes = [[rng.randrange(3) for _ in range(rng.randrange(0, 14))] for _ in range(3)]
    shadow = {b: [None] * BLOCK for b in range(pool.num_blocks)}
    live: list[Sequence] = []
    events = 0
    for i in range(4000):
        draining = i >= 600  # then no new traffic: everything admitted must finish (no deadlock)
        if not draining:
            for k in range(rng.choice([0, 0, 0, 1, 2])):
                seq = make_seq(rng, i * 10 + k, prefixes)
                scheduler.add(seq)
                live.append(seq)
            if live and rng.random() < 0.1:  # abort a random request, wherever it is
                victim = rng.choice(live)
                scheduler.finish(victim, "abort")
                live.remove(victim)
        batch = scheduler.schedule()
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                shadow[seq.block_table[pos // BLOCK]][pos % BLOCK] = seq.token_ids[pos]
        scheduler.advance(batch)
        events += len(batch.seqs) + len(batch.preempted)
        for seq in batch.seqs:
            if seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(rng.randrange(3))
                if seq.num_tokens >= seq.max_len:
                    scheduler.finish(seq, "length")
                    live.remove(seq)
        check_invariants(pool, live, shadow)
        if draining and not scheduler.has_unfinished():
            break
    assert not live and not scheduler.has_unfinished(), "requests starved or deadlocked"
    assert events > 1000
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_count == 0 for block in pool.blocks)
    assert pool.counters.hits > 0, "the workload shares prefixes; some must hit"
    if policy in ("continuous", "makespan"):
        assert scheduler.num_preemptions > 0, "the pool is small; preemption must be exercised"


def test_prefix_hit_leaves_last_token_to_compute():
    pool = BlockPool(num_blocks=8, block_size=BLOCK)
    first = Sequence("a", "a", 0, list(range(8)), 8, SamplingParams(), 16)
    pool.allocate(first, 8)
    first.num_computed_tokens = 8
    pool.register_full_blocks(first)
    second = Sequence("b", "b", 0, list(range(8)), 8, SamplingParams(), 16)
    pool.match_prefix(second)
    # Both blocks are cached, but the last token's logits are needed: only the first block is reused.
    assert second.num_computed_tokens == 4
    assert second.block_table == first.block_table[:1]
    third = Sequence("c", "c", 0, [0, 1, 2, 9, 4], 5, SamplingParams(), 16)
    pool.match_prefix(third)
    assert third.num_computed_tokens == 0
