"""The waiting queue: the policies' order with O(1) removal, and a step's host work bounded however
long the queue is (counted in key evaluations and sequence comparisons, never timed)."""

import random

import pytest

from goodserve import SamplingParams
from goodserve.config import EngineConfig
from goodserve.engine.core import makespan
from goodserve.engine.core.kv_cache_manager import KVCacheManager
from goodserve.engine.core.scheduler import Scheduler
from goodserve.engine.core.sequence import Sequence
from goodserve.engine.core.waiting_queue import WaitingQueue


def make_seq(i: int, priority: int = 0, max_tokens: int = 8, prompt_len: int = 4) -> Sequence:
    return Sequence(seq_id=f"s{i}", request_id=f"s{i}", index=0, token_ids=[7] * prompt_len,
                    num_prompt_tokens=prompt_len, params=SamplingParams(max_tokens=max_tokens, priority=priority),
                    max_len=prompt_len + max_tokens, arrival_time=float(i))


def test_order_and_removal_match_a_sorted_list():
    rng = random.Random(0)
    queue, reference = WaitingQueue(Sequence.priority_key), []
    for i in range(3000):
        if reference and rng.random() < 0.45:
            seq = reference.pop(rng.randrange(len(reference)))
            assert queue.remove(seq) and not queue.remove(seq)
        else:
            seq = make_seq(i, priority=rng.randint(-2, 2))
            queue.add(seq)
            reference.append(seq)
        if i % 100 == 0:
            assert queue.peek() is min(reference, key=Sequence.priority_key)
            assert len(queue) == len(reference) and list(queue) == reference
            assert list(queue.in_order()) == sorted(reference, key=Sequence.priority_key)
    assert len(queue._heap) <= 2 * len(reference) + 64  # removed entries do not pile up
    by_length = WaitingQueue(lambda seq: -seq.max_len)
    for seq in reference:
        by_length.add(seq)
    assert {s.seq_id for s in by_length.leading(lambda key: -key >= 10)} == \
        {s.seq_id for s in reference if s.max_len >= 10}


class Counts:
    """Counts the work a scheduler does per waiting sequence: order keys read, sequences compared."""

    def __init__(self, monkeypatch) -> None:
        self.n = 0
        for owner, name in ((Sequence, "priority_key"), (makespan, "longest_first_key"),
                            (makespan, "remaining_outputs"), (Sequence, "__eq__")):
            monkeypatch.setattr(owner, name, self.counted(getattr(owner, name)))

    def counted(self, fn):
        def wrapper(*args):
            self.n += 1
            return fn(*args)
        return wrapper


def work(monkeypatch, policy: str, num_waiting: int) -> tuple[int, int]:
    """Key reads and comparisons of one admitting step, and of aborting every waiting sequence."""
    counts = Counts(monkeypatch)
    config = EngineConfig(scheduler_policy=policy, max_num_seqs=4, max_num_batched_tokens=64, block_size=4)
    sched = Scheduler(config, KVCacheManager(num_blocks=64, block_size=4))
    seqs = [make_seq(i, max_tokens=8 + i % 5) for i in range(num_waiting)]
    for seq in seqs:
        sched.add(seq)
    counts.n = 0
    assert len(sched.schedule().seq_ids) == 4
    step = counts.n
    waiting = list(sched.waiting)[::-1]  # newest first: the worst order for a list
    counts.n = 0
    for seq in waiting:
        sched.finish(seq, "abort")
    assert not sched.waiting
    return step, counts.n


@pytest.mark.parametrize("policy", ["continuous", "makespan", "static"])
def test_a_step_and_aborts_do_not_scale_with_the_queue(monkeypatch, policy):
    small_step, small_abort = work(monkeypatch, policy, 100)
    large_step, large_abort = work(monkeypatch, policy, 2000)
    assert large_abort <= 25 * small_abort  # linear in the aborted count, not quadratic (400x)
    assert large_step <= small_step + 8  # bounded: the same step with 20x the queue
