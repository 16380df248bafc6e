"""The makespan policy: longest requests first, the rest spread over the longest one's steps."""

import pytest

from goodserve import LLM, SamplingParams
from goodserve.config import EngineConfig
from goodserve.engine.core.kv_cache_manager import KVCacheManager
from goodserve.engine.core.scheduler import Scheduler
from goodserve.engine.core.sequence import Sequence
from test_async_scheduling import drive, engine_mode


def offline_batch(scheduler: Scheduler, max_new: list[int], prompt_len: int = 4) -> list[Sequence]:
    seqs = []
    for i, n in enumerate(max_new):
        seq = Sequence(seq_id=f"s{i}", request_id=f"s{i}", index=0, token_ids=[7] * prompt_len,
                       num_prompt_tokens=prompt_len, params=SamplingParams(max_tokens=n),
                       max_len=prompt_len + n, arrival_time=float(i))
        scheduler.add(seq)
        seqs.append(seq)
    return seqs


def run_to_end(scheduler: Scheduler) -> list[tuple[list[str], int]]:
    """Steps the scheduler as the engine would (every sampled token appended, finished at max_len);
    returns each step's (sequence ids, tokens)."""
    steps = []
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        seqs = [scheduler.seqs[seq_id] for seq_id in out.seq_ids]
        scheduler.advance(out)
        steps.append((out.seq_ids, out.num_tokens))
        for seq in seqs:
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(7)
                if seq.num_tokens >= seq.max_len:
                    scheduler.finish(seq, "length")
    return steps


def scheduler(policy: str, **overrides) -> Scheduler:
    settings = {"max_num_seqs": 64, "max_num_batched_tokens": 256, "block_size": 4, **overrides}
    config = EngineConfig(scheduler_policy=policy, **settings)
    return Scheduler(config, KVCacheManager(num_blocks=512, block_size=4))


def test_longest_request_is_admitted_first():
    sched = scheduler("makespan", max_num_batched_tokens=4)  # room for one 4-token prompt a step
    offline_batch(sched, [3, 9, 5, 9])
    first = sched.schedule()
    assert first.seq_ids == ["s1"]  # the longest; of equal ones, the earliest
    continuous = scheduler("continuous", max_num_batched_tokens=4)
    offline_batch(continuous, [3, 9, 5, 9])
    assert continuous.schedule().seq_ids == ["s0"]


def test_short_requests_ride_along_the_longest_ones_steps():
    """One 60-token answer and forty 3-token ones. FCFS admits everything in the first step, then
    the long answer decodes alone; makespan admits the short ones over the long one's steps, with no
    more steps than the long answer needs (its prefill and its 60 tokens) and far smaller steps."""
    lengths = [3] * 20 + [60] + [3] * 20
    fcfs = run_to_end(_with_batch(scheduler("continuous"), lengths))
    spread = run_to_end(_with_batch(scheduler("makespan", makespan_min_admit=8), lengths))
    assert len(fcfs) == len(spread) == 60
    assert max(tokens for _, tokens in fcfs) == 41 * 4
    # All the work (41 prompts of 4, 40 x 3 + 60 output tokens, less the last tokens, never computed)
    # spread over 60 steps is ~5 tokens a step; the slack and min_admit allow some lumps.
    assert sum(tokens for _, tokens in spread) == sum(tokens for _, tokens in fcfs) == 41 * 4 + 40 * 2 + 59
    assert max(tokens for _, tokens in spread) <= 2 * 8 + 4
    assert spread[0][0][0] == "s20"  # the long one starts at once
    assert all(ids == ["s20"] for ids, _ in fcfs[3:])  # FCFS: the short ones are long gone
    assert sum(len(ids) > 1 for ids, _ in spread) > 40  # makespan: company on most steps


def _with_batch(sched: Scheduler, lengths: list[int]) -> Scheduler:
    offline_batch(sched, lengths)
    return sched


def test_async_steps_admit_what_the_policy_admits():
    """A step scheduled ahead (before the last one's tokens reach the host) admits waiting requests
    only when the policy would, and only those the engine can sample on the device."""
    sched = scheduler("makespan", makespan_min_admit=1 << 20)  # once one runs, admit no more
    long, *short = offline_batch(sched, [50, 1, 1])
    short[1].params = SamplingParams(max_tokens=1, logprobs=1)  # sampled on the host: never admitted ahead
    while True:
        out = sched.schedule()
        assert out.seq_ids == [long.seq_id]
        sched.advance(out)
        if long.num_computed_tokens == long.num_tokens:  # it sampled a token, not yet on the host
            if long.num_output_tokens:
                break
            long.token_ids.append(7)
    assert list(sched.waiting) == short
    ahead = sched.schedule(in_flight=[long])
    assert ahead is not None and ahead.num_ahead == 1 and ahead.seq_ids == [long.seq_id]
    assert ahead.token_ids == [[]] and ahead.samples == [True]  # its input is the token in flight
    long.token_ids.append(7)  # the engine's order: the step before returns its token, then this one advances
    sched.advance(ahead)
    sched.policy.min_admit, sched.policy.slack = 0, 100.0
    second = sched.schedule(in_flight=[long])
    assert second.seq_ids == [long.seq_id, "s1"] and second.num_new_tokens == [1, 4] and second.num_ahead == 1
    assert list(sched.waiting) == [short[1]]  # refused: the engine would have to sample it on the host


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_gives_the_same_tokens_as_fcfs(async_scheduling):
    prompts = [list(range(5 + i, 12 + 3 * i)) for i in range(7)]
    max_tokens = [4, 30, 6, 3, 12, 5, 2]
    arrivals = {0: [(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                    for i, (prompt, n) in enumerate(zip(prompts, max_tokens))]}
    results = {}
    for policy in ("continuous", "makespan"):
        llm = LLM("dummy:tiny", num_kv_blocks=64, scheduler_policy=policy, max_num_batched_tokens=64,
                  makespan_min_admit=16)
        with engine_mode(llm, graphs=True, async_scheduling=async_scheduling) as pipelined:
            results[policy] = {rid: out.outputs[0].token_ids for rid, out in drive(llm.engine, arrivals).items()}
            if async_scheduling and policy == "makespan":
                assert pipelined() > 0
        assert llm.engine.kv.num_used_blocks == 0
    assert results["makespan"] == results["continuous"]
    assert [len(results["makespan"][f"r{i}"]) for i in range(7)] == max_tokens
