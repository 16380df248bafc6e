"""Seeded random add / abort / finish / preempt traffic over the scheduler and block pool.

A shadow copy of the cache records which token each slot's K/V was computed for; after every step
each live sequence's computed positions must read back its own tokens, so a prefix-cache hit that
served a block holding other tokens cannot go unnoticed.
"""

import random

import pytest

import dataclasses

from goodserve.config import EngineConfig
from goodserve.engine.core.kv_cache_manager import KVCacheManager
from goodserve.engine.core.scheduler import Scheduler
from goodserve.engine.core.sequence import Sequence, SequenceStatus
from goodserve.engine.seam.runner_output import ModelRunnerOutput
from goodserve.engine.seam.scheduler_output import NewRequestData, SchedulerOutput
from goodserve.engine.spec_decode.draft_model import DraftModelProposer, load_draft
from goodserve.engine.spec_decode.policy import Speculator
from goodserve.engine.spec_decode.proposer import make_proposer
from goodserve.engine.worker.drafter import Drafter
from goodserve.model.presets import get_preset
from goodserve.sampling_params import SamplingParams

BLOCK = 4


def make_seq(rng: random.Random, i: int, prefixes: list[list[int]]) -> Sequence:
    prompt = list(rng.choice(prefixes)) + [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
    max_new = rng.randrange(1, 24)
    return Sequence(seq_id=f"s{i}", request_id=f"s{i}", index=0, token_ids=prompt,
                    num_prompt_tokens=len(prompt), params=SamplingParams(max_tokens=max_new),
                    max_len=len(prompt) + max_new, arrival_time=float(i))


def group_block(table: list[int], pos: int, group: int, num_groups: int) -> int:
    """Group `group`'s block of position pos in a table of interleaved groups."""
    return table[pos // BLOCK * num_groups + group]


def check_invariants(kv: KVCacheManager, live: list[Sequence], shadow: dict[int, list]) -> None:
    """With a window, a sequence's positions its next query reads (in every group) must still hold its
    own tokens, in blocks it still holds."""
    pool = kv.pool
    refs = [0] * pool.num_blocks
    for seq in live:
        held = kv.blocks_held(seq.seq_id)
        for block_id in held:
            refs[block_id] += 1
        for group, window in enumerate(kv.windows):
            oldest_key = 0 if window is None else max(seq.num_computed_tokens - window + 1, 0)
            for pos in range(oldest_key, seq.num_computed_tokens):
                block_id = group_block(kv.block_table(seq.seq_id), pos, group, kv.num_groups)
                assert block_id in held, "released a block still read"
                assert shadow[block_id][pos % BLOCK] == seq.token_ids[pos], "served a block with other tokens"
    for block in pool.blocks:
        assert block.ref_count == refs[block.block_id] >= 0
        assert (block.ref_count == 0) == (block.block_id in pool.free)
    for block_hash, block_id in pool.cached.items():
        assert pool.blocks[block_id].block_hash == block_hash


@pytest.mark.parametrize("policy,chunked,speculative,windows", [
    ("continuous", True, False, (None,)), ("continuous", False, False, (None,)), ("static", True, False, (None,)),
    ("makespan", True, False, (None,)), ("continuous", True, "ngram", (None,)), ("continuous", True, "draft", (None,)),
    ("continuous", True, False, (6,)), ("continuous", False, "ngram", (5,)),
    ("continuous", True, False, (6, 6, None)), ("continuous", True, "ngram", (None, 5))])
def test_random_traffic_leaks_nothing(policy, chunked, speculative, windows):
    """speculative: n-gram drafts (tokens 0..2 repeat, so most decodes draft) or a draft model's
    (dummy:tiny, with its own block pool, in a drafter fed as the runner feeds it), of which a random
    number is kept: the rejected ones' K/V slots are rolled back and rewritten; the draft's blocks
    are held by running sequences only.
    windows: each layer group's sliding window (several: a hybrid pool, engine/setup/kv_groups.py); blocks
    before it are released as sequences grow, and a prefix-cache hit must still serve only blocks
    holding the sequence's own tokens."""
    rng = random.Random(1234)
    config = EngineConfig(scheduler_policy=policy, max_num_seqs=6, max_num_batched_tokens=24 if chunked else 64,
                          enable_chunked_prefill=chunked, block_size=BLOCK,
                          speculative_method="ngram" if speculative == "ngram" else None, num_speculative_tokens=3,
                          spec_max_batch=6, spec_policy="always")
    kv = KVCacheManager(num_blocks=14 * len(windows), block_size=BLOCK, windows=windows)
    pool = kv.pool
    drafting = dataclasses.replace(config, speculative_model="dummy:tiny", num_kv_blocks=14, device="cpu",
                                   dtype="float32")
    drafter = Drafter(DraftModelProposer(drafting, load_draft(drafting, get_preset("tiny"), None))) \
        if speculative == "draft" else None
    scheduler = Scheduler(config, kv, Speculator(config, make_proposer(config)) if speculative else None)

    def tell_drafter(**news) -> None:  # what the engine sends the runner with a step
        if drafter is not None:
            drafter.update(SchedulerOutput(**news))

    prefixes = [[rng.randrange(3) for _ in range(rng.randrange(0, 14))] for _ in range(3)]
    shadow = {b: [None] * BLOCK for b in range(pool.num_blocks)}
    live: list[Sequence] = []
    events = released_early = 0
    for i in range(4000):
        draining = i >= 600  # then no new traffic: everything admitted must finish (no deadlock)
        if not draining:
            for k in range(rng.choice([0, 0, 0, 1, 2])):
                seq = make_seq(rng, i * 10 + k, prefixes)
                scheduler.add(seq)
                live.append(seq)
                tell_drafter(new_requests=[NewRequestData(seq.seq_id, seq.params, 0, list(seq.token_ids))])
            if live and rng.random() < 0.1:  # abort a random request, wherever it is
                victim = rng.choice(live)
                scheduler.finish(victim, "abort")
                live.remove(victim)
                tell_drafter(finished_seq_ids=[victim.seq_id])
        preemptions = scheduler.num_preemptions
        out = scheduler.schedule()
        by_id = {seq.seq_id: seq for seq in live}
        seqs = [by_id[seq_id] for seq_id in out.seq_ids] if out else []
        for row, seq in enumerate(seqs):
            start, n, table = out.num_computed_tokens[row], out.num_new_tokens[row], out.block_tables[row]
            drafts = out.draft_token_ids.get(row, [])
            assert table == kv.block_table(seq.seq_id)
            assert out.token_ids[row] == seq.token_ids[start : start + n - len(drafts)] + drafts
            for pos in range(start, start + n):
                for group in range(len(windows)):
                    shadow[group_block(table, pos, group, len(windows))][pos % BLOCK] = out.token_ids[row][pos - start]
        kept = {row: rng.randrange(len(drafts) + 1) for row, drafts in out.draft_token_ids.items()} if out else {}
        if out:
            scheduler.advance(out, {row: len(out.draft_token_ids[row]) - a for row, a in kept.items()})
        events += len(seqs) + scheduler.num_preemptions - preemptions
        if out:
            tell_drafter(preempted_seq_ids=out.preempted_seq_ids)
        output = ModelRunnerOutput([], [])  # the rows that sampled, and the tokens each kept
        for row, seq in enumerate(seqs):
            if seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens >= seq.num_tokens:
                output.sample_rows.append(row)
                output.token_ids.append(out.draft_token_ids.get(row, [])[: kept.get(row, 0)] + [rng.randrange(3)])
                seq.token_ids.extend(output.token_ids[-1])
        if drafter is not None:
            output.spec_token_ids = drafter.propose(out, output.sample_rows, output.token_ids)
        for seq in seqs:
            if seq.status is SequenceStatus.RUNNING and seq.num_tokens >= seq.max_len:
                scheduler.finish(seq, "length")
                live.remove(seq)
                tell_drafter(finished_seq_ids=[seq.seq_id])
        if out and speculative:
            scheduler.speculator.propose_next(out, output, scheduler.seqs, len(scheduler.running))
        check_invariants(kv, live, shadow)
        released_early += sum(len(kv.block_table(s.seq_id)) > len(kv.blocks_held(s.seq_id)) for s in live)
        if drafter is not None:
            assert set(drafter.proposer.kv.tables) <= {seq.seq_id for seq in scheduler.running}
        if draining and not scheduler.has_unfinished():
            break
    assert not live and not scheduler.has_unfinished(), "requests starved or deadlocked"
    assert events > 1000
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_count == 0 for block in pool.blocks)
    assert pool.counters.hits > 0, "the workload shares prefixes; some must hit"
    assert (released_early > 100) == (windows != (None,))
    if policy in ("continuous", "makespan"):
        assert scheduler.num_preemptions > 0, "the pool is small; preemption must be exercised"
    if speculative:
        assert scheduler.speculator.num_accepted_tokens > 500 and events > 1000
    if drafter is not None:
        assert drafter.proposer.kv.num_used_blocks == 0


def test_prefix_hit_leaves_last_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    first = Sequence("a", "a", 0, list(range(8)), 8, SamplingParams(), 16)
    kv.allocate(first, 8)
    first.num_computed_tokens = 8
    kv.register_full_blocks(first)
    second = Sequence("b", "b", 0, list(range(8)), 8, SamplingParams(), 16)
    # Both blocks are cached, but the last token's logits are needed: only the first block is reused.
    assert kv.match_prefix(second) == 4
    assert kv.block_table("b") == kv.block_table("a")[:1]
    third = Sequence("c", "c", 0, [0, 1, 2, 9, 4], 5, SamplingParams(), 16)
    assert kv.match_prefix(third) == 0


def test_pipeline_micro_batches_share_no_sequence_and_preempt_none_in_flight():
    """Three pipeline stages: the engine keeps a step in each, scheduling every new one around the
    sequences of those in flight (busy). No sequence is in two steps at once, none in flight is
    preempted (its blocks are being written), each step holds its share of the rows, and random
    aborts (in flight or not) and a small pool leak nothing."""
    rng = random.Random(99)
    stages = 3
    config = EngineConfig(max_num_seqs=9, max_num_batched_tokens=24, block_size=BLOCK,
                          pipeline_parallel_size=stages)
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    scheduler = Scheduler(config, kv)
    prefixes = [[rng.randrange(3) for _ in range(rng.randrange(0, 14))] for _ in range(3)]
    shadow = {b: [None] * BLOCK for b in range(kv.pool.num_blocks)}
    live: list[Sequence] = []
    in_flight: list[tuple] = []  # (out, seqs, their block tables at launch)
    max_overlap = 0
    for i in range(3000):
        if i < 500:
            for k in range(rng.choice([0, 0, 1, 2])):
                seq = make_seq(rng, i * 10 + k, prefixes)
                scheduler.add(seq)
                live.append(seq)
            if live and rng.random() < 0.1:
                victim = rng.choice(live)
                scheduler.finish(victim, "abort")
                live.remove(victim)
        while len(in_flight) < stages:
            busy = [seq for _, seqs, _ in in_flight for seq in seqs]
            rows = -(-min(len(scheduler.running) + len(scheduler.waiting), config.max_num_seqs) // stages)
            out = scheduler.schedule(busy=busy)
            if not out:
                break
            by_id = {seq.seq_id: seq for seq in live}
            seqs = [by_id[seq_id] for seq_id in out.seq_ids]
            assert not {seq.seq_id for seq in seqs} & {seq.seq_id for seq in busy}, "a sequence in two steps"
            assert len(seqs) <= rows
            for row, seq in enumerate(seqs):
                start, n, table = out.num_computed_tokens[row], out.num_new_tokens[row], out.block_tables[row]
                for pos in range(start, start + n):
                    shadow[table[pos // BLOCK]][pos % BLOCK] = out.token_ids[row][pos - start]
            in_flight.append((out, seqs, [list(kv.block_table(seq.seq_id)) for seq in seqs]))
            max_overlap = max(max_overlap, len(in_flight))
        for _, seqs, tables in in_flight:  # nothing in flight lost its blocks but to an abort
            for seq, table in zip(seqs, tables):
                assert seq.is_finished or (seq.status is SequenceStatus.RUNNING and kv.block_table(seq.seq_id) == table)
        if not in_flight:
            if i >= 500 and not scheduler.has_unfinished():
                break
            continue
        out, seqs, _ = in_flight.pop(0)
        scheduler.advance(out)
        for seq in seqs:
            if seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens >= seq.num_tokens:
                seq.token_ids.append(rng.randrange(3))
                if seq.num_tokens >= seq.max_len:
                    scheduler.finish(seq, "length")
                    live.remove(seq)
        check_invariants(kv, live, shadow)
    assert not live and not scheduler.has_unfinished() and not in_flight, "requests starved or deadlocked"
    assert max_overlap == stages
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert scheduler.num_preemptions > 0, "the pool is small; preemption must be exercised"


def test_a_hybrid_prefix_hit_needs_only_the_local_blocks_its_window_reads():
    """Two layer groups, a local one (window 8) and a global one. A sequence grows to 40 tokens, its
    local blocks before its window released as it goes, and finishes; another takes every block that
    was free before that finish, evicting those early local blocks from the prefix cache. A sequence
    with the same 40 tokens first still hits all of them: it takes the global blocks and the local
    blocks its next query reads, the earlier local entries being placeholders it does not hold."""
    kv = KVCacheManager(num_blocks=40, block_size=BLOCK, windows=(8, None))
    first = Sequence("a", "a", 0, list(range(41)), 41, SamplingParams(), 64)
    for start in range(0, 40, 8):
        first.num_computed_tokens = start
        assert kv.allocate(first, 8)
        first.num_computed_tokens = start + 8
        kv.register_full_blocks(first)
    assert kv.allocate(first, 1)  # releases the local blocks before the window of the query at 40
    table, free_before = list(kv.block_table("a")), kv.num_free_blocks
    kv.free(first, finished=True)
    filler = Sequence("f", "f", 0, [99] * 64, 64, SamplingParams(), 64)
    assert kv.allocate(filler, free_before // 2 * BLOCK) and kv.num_free_blocks == kv.num_blocks - free_before
    second = Sequence("b", "b", 0, list(range(40)) + [7], 41, SamplingParams(), 64)
    assert kv.match_prefix(second) == 40
    local_read = [table[i * 2] for i in range(8, 10)]  # the query at 40 reads keys 33..40: blocks 8 and 9
    global_blocks = [table[i * 2 + 1] for i in range(10)]
    assert sorted(kv.blocks_held("b")) == sorted(local_read + global_blocks)
    assert kv.block_table("b")[16::2] == local_read and kv.block_table("b")[1::2] == global_blocks
