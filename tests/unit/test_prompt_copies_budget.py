"""n copies of a prompt served by the prefix cache, on the torch attention path (the CPU's): each copy's
step attends its whole cached prompt, so the copies count those tokens against the step's budget and
enter over several steps, never one step reading n whole prompts beside an innocent request's first
token. Counted in the context tokens the steps' rows read, never timed."""

import pytest

from goodserve import SamplingParams
from goodserve.config import EngineConfig
from goodserve.engine.core.kv_cache_manager import KVCacheManager
from goodserve.engine.core.scheduler import Scheduler
from goodserve.engine.seam.scheduler_output import SchedulerOutput
from goodserve.engine.core.sequence import Sequence
from test_slo_scheduler import decode_step

BUDGET = 2048
PROMPT = [1 + i % 50 for i in range(1001)]  # 250 full blocks of 4 cached for each copy, 1 token its own
COPIES = 127


def scheduler(backend: str) -> Scheduler:
    config = EngineConfig(attention_backend=backend, max_num_seqs=256, max_num_batched_tokens=BUDGET, block_size=4)
    return Scheduler(config, KVCacheManager(4096, block_size=4))


def sequence(seq_id: str, request_id: str, index: int, prompt: list[int], arrival: float) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=request_id, index=index, token_ids=list(prompt),
                    num_prompt_tokens=len(prompt), params=SamplingParams(max_tokens=200, ignore_eos=True),
                    max_len=len(prompt) + 200, arrival_time=arrival)


def copies_read(out: SchedulerOutput) -> list[int]:
    """The context each copy of the fanned-out prompt that joined this step reads (cached + new)."""
    return [computed + new for seq_id, computed, new in zip(out.seq_ids, out.num_computed_tokens, out.num_new_tokens)
            if seq_id.startswith("copy") and computed + new <= len(PROMPT)]


def fan_out_beside_innocent(sched: Scheduler) -> list[SchedulerOutput]:
    """A request of n = 128 and, just after it, an innocent one of 1,100 prompt tokens: the first copy
    and the innocent's first chunk fill step 0; the other copies join once the prompt is cached (as
    the engine releases them); the steps up to the innocent's first token."""
    sched.add(sequence("copy0", "fan", 0, PROMPT, arrival=0.0))
    innocent = sequence("innocent", "innocent", 0, [60 + i % 30 for i in range(1100)], arrival=1.0)
    sched.add(innocent)
    steps = [decode_step(sched)]
    assert steps[0].seq_ids == ["copy0", "innocent"] and innocent.num_output_tokens == 0
    for index in range(1, COPIES + 1):
        sched.add(sequence(f"copy{index}", "fan", index, PROMPT, arrival=0.0))
    while innocent.num_output_tokens == 0:
        steps.append(decode_step(sched))
    return steps


def test_copies_served_by_the_prefix_cache_enter_over_bounded_steps_on_the_torch_path():
    sched = scheduler("torch")
    steps = fan_out_beside_innocent(sched)
    assert len(steps) == 2  # the innocent's first token comes in the next step, as without the copies
    admitted = copies_read(steps[1])
    assert admitted and admitted[0] == len(PROMPT) and sum(admitted) <= BUDGET
    seen = len(admitted)
    while seen < COPIES:  # the rest: some each step, more than one only within the budget
        admitted = copies_read(decode_step(sched))
        assert admitted and (len(admitted) == 1 or sum(admitted) <= BUDGET)
        seen += len(admitted)
    assert not sched.waiting


def test_a_request_behind_the_waiting_copies_passes_them_on_the_torch_path():
    """One that arrives once the copies wait is admitted in the next step, not after all of them;
    they go on entering, first in line."""
    sched = scheduler("torch")
    fan_out_beside_innocent(sched)
    late = sequence("late", "late", 0, [90] * 20, arrival=2.0)
    sched.add(late)
    out = decode_step(sched)
    assert "late" in out.seq_ids and late.num_output_tokens == 1 and sum(copies_read(out)) <= BUDGET
    assert copies_read(decode_step(sched))  # the copies still enter


def test_a_sequence_passed_over_keeps_the_kv_it_was_sent():
    """A decode request whose prompt's K/V came from a prefill engine waits holding those blocks: passed
    over for a step, it keeps them (nothing to recompute) and joins the next step for its one token."""
    sched = scheduler("torch")
    sched.add(sequence("fresh", "fresh", 0, [3] * (BUDGET - 48), arrival=0.0))
    moved = sequence("moved", "moved", 0, PROMPT, arrival=1.0)
    assert sched.kv.allocate(moved, len(PROMPT) - 1)
    moved.num_computed_tokens = len(PROMPT) - 1
    blocks = list(sched.kv.block_table("moved"))
    sched.add(moved)
    assert decode_step(sched).seq_ids == ["fresh"]  # the budget spent: moved passed over
    assert sched.kv.block_table("moved") == blocks and moved.num_computed_tokens == len(PROMPT) - 1
    out = decode_step(sched)
    assert "moved" in out.seq_ids and out.num_new_tokens[out.seq_ids.index("moved")] == 1


def test_triton_path_admits_every_copy_at_once():
    """The Triton prefill kernel reads the rows' contexts in parallel: there the copies pay only their
    own tokens, and all of them join the innocent's first-token step (what the torch path must not do)."""
    steps = fan_out_beside_innocent(scheduler("triton"))
    assert len(steps) == 2 and len(copies_read(steps[1])) == COPIES


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fresh_prompts_fill_the_budget_alike(backend):
    """Prompts without a cached prefix read only their new tokens: the rule changes nothing for them."""
    sched = scheduler(backend)
    for i in range(5):
        sched.add(sequence(f"p{i}", f"p{i}", 0, [100 + i] * 500, arrival=float(i)))
    assert decode_step(sched).num_new_tokens == [500, 500, 500, 500, 48]
