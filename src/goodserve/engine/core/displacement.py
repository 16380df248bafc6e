"""Which running sequences the waiting ones displace: priority preemption, planned before a step.

A waiting sequence of a higher priority (a lower SamplingParams.priority: an online request) that
finds no sequence slot or KV block takes those of the lowest-priority running one (a batch line),
which waits to resume: lower priorities only ever fill the room higher ones leave. The policy says
who has room and who goes first; this walk applies its answers to the whole queue at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from goodserve.engine.core.kv_cache_manager import KVCacheManager
from goodserve.engine.core.sequence import Sequence
from goodserve.engine.core.waiting_queue import WaitingQueue

if TYPE_CHECKING:
    from goodserve.engine.core.scheduling_policy import SchedulingPolicy


def displaced_running(policy: SchedulingPolicy, running: list[Sequence], waiting: WaitingQueue, kv: KVCacheManager,
                      busy: frozenset[str] = frozenset()) -> list[Sequence]:
    """The running sequences (none of `busy`, those a micro-batch in flight computes) the waiting
    ones this step can admit displace: each waiting one in order, while the step's prompt-token
    budget lasts, that finds no sequence slot or no KV blocks for its first chunk takes those of the
    lowest-priority running one, if that one's priority is lower. All of a burst at once: one a step
    made the tenth online arrival behind a full batch job wait ten steps."""
    head = waiting.peek()
    if head is None or all(seq.params.priority <= head.params.priority for seq in running):
        return []  # (the common case, no walk down the queue)
    budget = policy.displacement_budget()
    taken = len(running)  # slots held once the victims so far leave and the heads so far join
    tokens = policy.running_tokens  # and their tokens, what their decode rows read
    free_blocks = kv.num_free_blocks
    candidates = sorted((seq for seq in running if seq.seq_id not in busy), key=policy.victim_key,
                        reverse=True)  # the first to go first
    victims: list[Sequence] = []
    for head in waiting.in_order():
        if budget <= 0:
            break
        chunk = min(head.num_uncomputed_tokens, budget)
        needed = kv.blocks_needed(head, chunk)
        while not policy.has_room(head, taken, tokens) or free_blocks < needed:
            if len(victims) == len(candidates) or candidates[len(victims)].params.priority <= head.params.priority:
                return victims
            victim = candidates[len(victims)]
            victims.append(victim)
            taken, tokens = taken - 1, tokens - victim.num_tokens
            free_blocks += len(kv.blocks_held(victim.seq_id))
        taken, tokens = taken + 1, tokens + head.num_tokens
        free_blocks -= needed
        budget -= chunk
    return victims
