"""The "slo" policy on a scripted clock and a hand-set step-time fit: waiting order by slack, late
requests behind the ones that can still make it, the prefill cap, the preemption victim."""

import math

import pytest

from goodserve import SamplingParams
from goodserve.config import EngineConfig
from goodserve.engine.core import slo_policy
from goodserve.engine.frontend.admission import BEST_EFFORT_PRIORITY, Admission
from goodserve.engine.core.forecast import Forecast
from goodserve.engine.core.kv_cache_manager import KVCacheManager
from goodserve.engine.core.scheduler import Scheduler
from goodserve.engine.seam.scheduler_output import SchedulerOutput
from goodserve.engine.core.sequence import Sequence
from goodserve.engine.core.step_time_model import StepTimeFit, step_shape

# 10 ms a step, 1 ms a decode row, 0.1 ms a prompt token
FIT = StepTimeFit(a=0.010, b=0.001, c=0.0001)


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def scheduler(policy: str, num_blocks: int = 1024, fit: StepTimeFit | None = FIT, **overrides) -> Scheduler:
    settings = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "block_size": 4, **overrides}
    sched = Scheduler(EngineConfig(scheduler_policy=policy, **settings), KVCacheManager(num_blocks, block_size=4))
    sched.step_time.fit = fit
    return sched


def set_clock(sched: Scheduler, clock: Clock) -> None:
    """The slo policy reads the clock; the others (their schedules compared against it) need none."""
    if isinstance(sched.policy, slo_policy.SloPolicy):
        sched.policy.clock = clock


def request(sched: Scheduler, name: str, arrival: float, prompt_len: int = 4, ttft_ms: float | None = None,
            tpot_ms: float | None = None, priority: int = 0, max_tokens: int = 100, first_token: int = 1) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, slo_ttft_ms=ttft_ms, slo_tpot_ms=tpot_ms, priority=priority)
    seq = Sequence(seq_id=name, request_id=name, index=0, token_ids=list(range(first_token, first_token + prompt_len)),
                   num_prompt_tokens=prompt_len, params=params, max_len=prompt_len + 100, arrival_time=arrival)
    sched.add(seq)
    return seq


def admitted_in_order(sched: Scheduler) -> list[str]:
    """The waiting sequences in the order they are admitted, one a step (the step holds one prompt)."""
    order = []
    while sched.waiting:
        out = sched.schedule()
        order += [seq_id for seq_id in out.seq_ids if seq_id not in order]
        sched.advance(out)
    return order


def decode_step(sched: Scheduler) -> SchedulerOutput:
    """One step as the engine runs it: the scheduled tokens computed, a token appended to each sampler."""
    out = sched.schedule()
    sched.advance(out)
    for seq_id, samples in zip(out.seq_ids, out.samples):
        if samples:
            sched.seqs[seq_id].token_ids.append(7)
    return out


def test_waiting_order_is_by_slack_not_arrival_or_deadline():
    """Slack = deadline - predicted prefill. 'long' (2,000-token prompt, 0.21 s of prefill by the fit)
    has the later deadline but must start first; 'none' (no target) comes last though it came first."""
    clock = Clock(0.0)
    sched = scheduler("slo", max_num_batched_tokens=2000)
    sched.policy.clock = clock
    request(sched, "none", arrival=-1.0, prompt_len=2000)
    request(sched, "short", arrival=0.0, prompt_len=200, ttft_ms=300)  # latest start 0.3 - 0.03 = 0.27
    request(sched, "long", arrival=0.05, prompt_len=2000, ttft_ms=350)  # latest start 0.4 - 0.21 = 0.19
    assert admitted_in_order(sched) == ["long", "short", "none"]
    fcfs = scheduler("continuous", max_num_batched_tokens=2000)
    request(fcfs, "none", arrival=-1.0, prompt_len=2000)
    request(fcfs, "short", arrival=0.0, prompt_len=200, ttft_ms=300)
    request(fcfs, "long", arrival=0.05, prompt_len=2000, ttft_ms=350)
    assert admitted_in_order(fcfs) == ["none", "short", "long"]


def test_priority_comes_before_slack():
    sched = scheduler("slo", max_num_batched_tokens=4)
    sched.policy.clock = Clock(0.0)
    request(sched, "batch", arrival=0.0, ttft_ms=10, priority=1 << 30)
    request(sched, "online", arrival=0.0, ttft_ms=5000)
    assert admitted_in_order(sched) == ["online", "batch"]


def test_a_request_past_its_latest_start_waits_behind_those_that_can_still_make_it():
    clock = Clock(10.0)
    sched = scheduler("slo", max_num_batched_tokens=4)
    sched.policy.clock = clock
    request(sched, "late", arrival=9.0, ttft_ms=200)  # its deadline was 9.2
    request(sched, "on_time", arrival=9.95, ttft_ms=200)
    request(sched, "later", arrival=9.98, ttft_ms=200)
    assert admitted_in_order(sched) == ["on_time", "later", "late"]


def planned_cap(sched: Scheduler) -> int:
    """The prefill cap the next step is planned with."""
    sched.policy.begin_step(sched.running)
    return sched.policy.cap


def test_prefill_cap_keeps_the_running_decodes_tpot():
    """Ten decodes with a 50 ms TPOT target that just gave their first token and have one more to
    give: nothing to make up for a long step, so it may last 50 ms; 10 ms + 10 x 1 ms leave 30 ms,
    300 prompt tokens at 0.1 ms. FCFS gives the prompt all the step's budget."""
    for policy, chunk in [("slo", 300), ("continuous", 2048 - 10)]:
        sched = scheduler(policy, num_blocks=4096)
        set_clock(sched, Clock(0.0))
        for i in range(10):
            request(sched, f"d{i}", arrival=0.0, ttft_ms=1000, tpot_ms=50, max_tokens=2)
        decode_step(sched)
        request(sched, "prompt", arrival=0.0, prompt_len=8000, ttft_ms=5000, tpot_ms=50)
        assert decode_step(sched).num_new_tokens == [1] * 10 + [chunk], policy


def test_prefill_cap_lets_a_long_answer_make_up_for_a_long_step():
    """Ten decodes that just gave their first token, 99 to go; a decode-only step takes 20 ms by the fit.
    Over the next 16 tokens a 50 ms target saves 30 ms a token, 480 ms: the step may hold all 2,048
    tokens. A 25 ms target saves 5 ms a token: 17 x 25 - 16 x 20 = 105 ms, so 85 ms of prompt tokens
    beside the decodes' 20, 850."""
    for tpot_ms, cap in [(50, 2048), (25, 850)]:
        clock = Clock(0.0)
        sched = scheduler("slo", num_blocks=4096)
        sched.policy.clock = clock
        seqs = [request(sched, f"d{i}", arrival=0.0, tpot_ms=tpot_ms) for i in range(10)]
        decode_step(sched)
        for seq in seqs:
            seq.metrics.first_token_time = 0.0
        assert planned_cap(sched) == cap, tpot_ms


def test_no_cap_without_a_fit_or_a_tpot_target():
    for fit, tpot_ms in [(None, 50), (FIT, None)]:
        sched = scheduler("slo", fit=fit)
        sched.policy.clock = Clock(0.0)
        for i in range(10):
            request(sched, f"d{i}", arrival=0.0, tpot_ms=tpot_ms)
        decode_step(sched)
        request(sched, "prompt", arrival=0.0, prompt_len=4000)
        assert sched.schedule().num_new_tokens == [1] * 10 + [2038]


def test_preemption_picks_the_request_with_the_most_slack():
    """Three 4-token prompts fill 3 of 4 blocks; their 5th tokens need a block each. After s0 takes the
    last one, s1 or s2 must go: FCFS preempts the newest (s2); slo the one with the most slack,
    s1, which has no TPOT target, where s2 is 10 ms from missing its 50 ms."""
    for policy, victim in [("slo", "s1"), ("continuous", "s2")]:
        clock = Clock(100.0)
        sched = scheduler(policy, num_blocks=4)
        set_clock(sched, clock)
        seqs = [request(sched, "s0", 99.0, tpot_ms=50), request(sched, "s1", 99.1),
                request(sched, "s2", 99.2, tpot_ms=50)]
        decode_step(sched)
        for seq in seqs:
            seq.metrics.first_token_time = 99.96
        assert sorted(decode_step(sched).seq_ids) == sorted({"s0", "s1", "s2"} - {victim}), policy
        assert sched.seqs[victim].metrics.num_preemptions == 1


def test_forecast_predicts_ttft_from_the_queue_ahead():
    sched = scheduler("slo")
    sched.policy.clock = Clock(0.0)
    for i in range(10):
        request(sched, f"d{i}", arrival=0.0, tpot_ms=50, max_tokens=2)
    decode_step(sched)
    decode_step(sched)  # (the cap is the last step's: this one's decodes carry the targets)
    forecast = sched.forecast()
    assert (forecast.decode_rows, forecast.prefill_tokens_per_step) == (10, 300)
    # 600 tokens ahead and its own 150: two 300-token steps of 10 + 10 + 30 ms, one of 150, 35 ms
    assert forecast.ttft_seconds(600, 150) == pytest.approx(0.135)
    # their last tokens are out; 40 rows make a 50 ms decode step (their TPOT target), 30 more
    assert (forecast.free_seqs, forecast.steps_to_finish) == (30, (0,) * 10)


def test_forecast_waits_for_a_free_sequence_slot():
    """No free slot; the running sequences finish in 3, 5 and 40 steps of 13 ms (10 + 3 x 1 ms). A
    request behind one waiting sequence needs the second slot to free: 5 steps, 65 ms, then its own
    100-token prompt, 23 ms. Behind four it waits for the batch to turn over: 40 + 3 steps."""
    forecast = Forecast(FIT, decode_rows=3, prefill_tokens_per_step=2048, free_seqs=0, steps_to_finish=(3, 5, 40))
    assert forecast.ttft_seconds(0, 100, seqs_ahead=1) == pytest.approx(0.065 + 0.023)
    assert forecast.ttft_seconds(0, 100, seqs_ahead=3) == pytest.approx(43 * 0.013 + 0.023)
    # tokens ahead that take longer than the wait for a slot are what counts
    assert forecast.ttft_seconds(10_000, 100, seqs_ahead=1) == pytest.approx(forecast.ttft_seconds(10_000, 100))


def test_decodes_ahead_of_their_tpot_let_a_step_carry_more_prompt():
    """The decodes' first tokens came 1 s ago and they have 100 tokens each, their last: at 50 ms a
    token they could have taken 5 s, so the next step may last 4 s, more than the 2,048 tokens a step
    holds. One that is behind its pace keeps the cap at its 50 ms: 300 tokens beside the 20 ms of decodes."""
    clock = Clock(100.0)
    sched = scheduler("slo", num_blocks=4096)
    sched.policy.clock = clock
    seqs = [request(sched, f"d{i}", arrival=98.0, tpot_ms=50) for i in range(10)]
    decode_step(sched)
    for seq in seqs:  # 99 tokens more, all but the last computed
        seq.token_ids += [7] * 99
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.metrics.first_token_time = 99.0
    assert planned_cap(sched) == 2048
    seqs[0].metrics.first_token_time = 100.0 - 0.050 * 99 - 0.001  # 1 ms behind its pace
    assert planned_cap(sched) == 300


BATCH = 1 << 30  # server/batch_lines.BATCH_PRIORITY


@pytest.mark.parametrize("policy", ["slo", "continuous"])
def test_an_online_request_takes_a_batch_lines_sequence_slot(policy):
    """Batch lines fill every sequence slot; an online request that arrives runs in the next step, in
    the place of the newest batch line (no targets: its slack is infinite), which waits to resume."""
    clock = Clock(0.0)
    sched = scheduler(policy, max_num_seqs=2)
    set_clock(sched, clock)
    request(sched, "b0", 0.0, priority=BATCH)
    request(sched, "b1", 0.1, priority=BATCH)
    decode_step(sched)
    clock.now = 0.2
    request(sched, "online", 0.2, ttft_ms=200, tpot_ms=50)
    assert sorted(decode_step(sched).seq_ids) == ["b0", "online"]
    assert sched.seqs["b1"].metrics.num_preemptions == 1
    assert [seq.seq_id for seq in sched.waiting] == ["b1"]


@pytest.mark.parametrize("policy", ["slo", "continuous"])
def test_an_online_request_takes_a_batch_lines_kv_blocks(policy):
    """Two batch lines hold all 4 KV blocks (4 tokens a block; 7 prompt tokens and their first answer
    each); the online request's 4-token prompt needs one: a batch line gives its blocks up (and takes
    back what the online request leaves, to recompute its prompt)."""
    sched = scheduler(policy, num_blocks=4)
    set_clock(sched, Clock(0.0))
    request(sched, "b0", 0.0, prompt_len=7, priority=BATCH)
    request(sched, "b1", 0.1, prompt_len=7, priority=BATCH)
    decode_step(sched)
    request(sched, "online", 0.2, ttft_ms=200)
    assert "online" in decode_step(sched).seq_ids
    assert sum(sched.seqs[b].metrics.num_preemptions for b in ("b0", "b1")) == 1


@pytest.mark.parametrize("policy", ["slo", "continuous"])
def test_a_burst_of_online_requests_displaces_batch_lines_in_one_step(policy):
    """Four batch lines hold all four slots; three online requests arrive together: all three run in
    the next step (not one a step), in the places of the three newest batch lines."""
    sched = scheduler(policy, max_num_seqs=4)
    set_clock(sched, Clock(0.0))
    for i in range(4):
        request(sched, f"b{i}", 0.1 * i, priority=BATCH)
    decode_step(sched)
    for i in range(3):
        request(sched, f"online{i}", 1.0, ttft_ms=200, tpot_ms=50)
    assert sorted(decode_step(sched).seq_ids) == ["b0", "online0", "online1", "online2"]
    assert sorted(seq.seq_id for seq in sched.waiting) == ["b1", "b2", "b3"]


@pytest.fixture
def share_20_percent(monkeypatch):
    """A background share of 20% (FIT's 1 ms rows need a share that large to show in a small step)."""
    monkeypatch.setattr(slo_policy, "BACKGROUND_SHARE", 0.2)


def test_batch_lines_get_a_bounded_share_of_a_step_while_online_requests_run(share_20_percent):
    """FIT: one online decode row makes an 11 ms step; batch work may add 20% of it, half in decode rows
    (1.1 ms / 1 ms a row: 1 row) and half in prompt tokens (1.1 ms / 0.1 ms: 11 tokens a step, banked:
    a prompt computes whole once the bank covers it)."""
    sched = scheduler("slo")
    sched.policy.clock = Clock(0.0)
    request(sched, "online", 0.0, ttft_ms=200, tpot_ms=50)
    decode_step(sched)
    for i in range(4):
        request(sched, f"b{i}", 0.1 + i, prompt_len=8, priority=BATCH, first_token=100 * (i + 1))  # no prefix hits
    out = decode_step(sched)  # 11 banked: b0's 8; b1 waits for its 8 (3 left)
    assert dict(zip(out.seq_ids, out.num_new_tokens)) == {"online": 1, "b0": 8}
    out = decode_step(sched)  # b0 now decodes: the one row; 14 banked: b1's 8
    assert dict(zip(out.seq_ids, out.num_new_tokens)) == {"online": 1, "b0": 1, "b1": 8}
    out = decode_step(sched)  # b1 decodes too: one row is the share; b0, the first in order, takes it; 17: b2, b3
    assert dict(zip(out.seq_ids, out.num_new_tokens)) == {"online": 1, "b0": 1, "b2": 8, "b3": 8}
    sched.finish(sched.seqs["online"], "stop")
    out = decode_step(sched)  # nothing online: the batch fills the step
    assert dict(zip(out.seq_ids, out.num_new_tokens)) == {"b0": 1, "b1": 1, "b2": 1, "b3": 1}


def online_decodes_beside_batch_lines(num_lines: int) -> Scheduler:
    """Ten online requests decoding (FIT: a 20 ms step; the background share lends batch prompts half of
    10% of it, 1 ms, 10 tokens a step) and num_lines batch lines of 200-token prompts waiting."""
    sched = scheduler("slo")
    sched.policy.clock = Clock(0.0)
    for i in range(10):
        request(sched, f"online{i}", 0.0, ttft_ms=200, tpot_ms=50, first_token=10 * i + 1)
    decode_step(sched)
    for i in range(num_lines):
        request(sched, f"b{i}", 0.0, prompt_len=200, priority=BATCH, first_token=10_000 + 1000 * i)
    return sched


def test_batch_prompts_compute_whole_in_one_step_of_twenty():
    """The share's 10 tokens a step are banked: each 200-token batch prompt computes whole, in one step
    of 20, and the steps between carry no unfinished prompt (they sample in every row: async
    scheduling launches them ahead), where a 10-token slice a step left one in every step. Over 60
    steps the job gets the share's 600 tokens, within one prompt."""
    sched = online_decodes_beside_batch_lines(8)
    steps_with_prompts = prompt_tokens = 0
    for _ in range(60):
        out = decode_step(sched)
        chunks = [n for seq_id, n in zip(out.seq_ids, out.num_new_tokens) if seq_id.startswith("b") and n > 1]
        assert all(n == 200 for n in chunks) and out.all_sample
        steps_with_prompts += bool(chunks)
        prompt_tokens += sum(chunks)
    assert steps_with_prompts <= math.ceil(60 / 20)
    assert 60 * 10 - 200 <= prompt_tokens <= 60 * 10


def test_a_batch_prompt_the_bank_covers_joins_a_step_scheduled_ahead():
    """A batch line that arrives while a step is in flight joins the step scheduled ahead of it (async
    scheduling admits waiting sequences there) whole, once 20 steps have banked its 200 tokens: that
    step samples in every row, so the one after it can run ahead too."""
    sched = online_decodes_beside_batch_lines(0)
    for _ in range(20):
        decode_step(sched)
    in_flight = sched.schedule()
    sched.advance(in_flight)
    request(sched, "b0", 0.0, prompt_len=200, priority=BATCH, first_token=10_000)
    ahead = sched.schedule(in_flight=[sched.seqs[seq_id] for seq_id in in_flight.seq_ids])
    assert dict(zip(ahead.seq_ids, ahead.num_new_tokens))["b0"] == 200 and ahead.all_sample


def test_a_request_of_the_same_priority_waits_for_a_slot():
    sched = scheduler("slo", max_num_seqs=2)
    sched.policy.clock = Clock(0.0)
    request(sched, "a", 0.0, ttft_ms=200)
    request(sched, "b", 0.1, ttft_ms=200)
    decode_step(sched)
    request(sched, "c", 0.2, ttft_ms=200)
    assert sorted(decode_step(sched).seq_ids) == ["a", "b"]
    assert sched.num_preemptions == 0


def test_forecast_counts_batch_lines_slots_as_free():
    """An online request would take a batch line's slot at once: no wait for the batch to finish. Nor do
    the batch lines' rows count in its steps: they give way first (and add the background share at most)."""
    sched = scheduler("slo", max_num_seqs=3)
    sched.policy.clock = Clock(0.0)
    request(sched, "online", 0.0, ttft_ms=200, max_tokens=10)
    request(sched, "b0", 0.0, priority=BATCH)
    request(sched, "b1", 0.0, priority=BATCH)
    decode_step(sched)
    forecast = sched.forecast()
    assert (forecast.free_seqs, forecast.steps_to_finish, forecast.decode_rows) == (2, (9,), 1)


def test_running_sequences_are_capped_by_the_tightest_tpot_target():
    """FIT: 10 ms a step and 1 ms a decode row, so 40 rows keep a decode step within 50 ms and 20
    within 30 ms. max_num_seqs (64) stays the ceiling; FCFS and requests without a TPOT target
    run up to it."""
    def running_after_one_step(policy: str, tpots: list) -> int:
        sched = scheduler(policy)
        set_clock(sched, Clock(0.0))
        for i, tpot_ms in enumerate(tpots):
            request(sched, f"r{i}", arrival=0.001 * i, ttft_ms=1000, tpot_ms=tpot_ms, first_token=10 * i + 1)
        decode_step(sched)
        return len(sched.running)

    assert running_after_one_step("slo", [50] * 50) == 40
    assert running_after_one_step("slo", [30] + [50] * 49) == 20  # the first one's target binds them all
    assert running_after_one_step("slo", [None] * 70) == 64
    assert running_after_one_step("continuous", [50] * 70) == 64


@pytest.mark.parametrize("policy, asked, resolved", [("continuous", None, 256), ("slo", None, 1024),
                                                     ("slo", 64, 64), ("continuous", 1024, 1024)])
def test_the_sequence_ceiling_defaults_higher_under_slo(policy, asked, resolved):
    """slo sizes its batch from the TPOT target, so its ceiling only bounds graphs and memory."""
    from goodserve.engine.setup.config_resolution import resolve_for_device

    config = EngineConfig(device="cpu", scheduler_policy=policy, max_num_seqs=asked)
    assert resolve_for_device(config).max_num_seqs == resolved


def test_online_requests_displace_batch_lines_down_to_the_tpot_limit():
    """35 batch lines run (no targets: up to the 64 of max_num_seqs); 10 online requests with a 50 ms
    TPOT target may run 40 at once (FIT): 5 batch lines give their slots up, and all 10 run."""
    sched = scheduler("slo")
    sched.policy.clock = Clock(0.0)
    for i in range(35):
        request(sched, f"b{i}", 0.01 * i, priority=BATCH, first_token=10 * i + 1)
    decode_step(sched)
    for i in range(10):
        request(sched, f"online{i}", 1.0, ttft_ms=200, tpot_ms=50, first_token=1000 + 10 * i)
    out = decode_step(sched)
    assert {f"online{i}" for i in range(10)} <= set(out.seq_ids)
    assert len(sched.running) == 40 and len(sched.waiting) == 5


def test_forecast_leaves_out_prompts_not_ahead_of_a_new_request():
    """The admission check counts every request that has not answered. Of those, 'long' runs (its slot
    is taken) and 200 of its 300 prompt tokens are computed; 'late' (past its TTFT) and 'best' (best
    effort) wait behind a new request. Ahead of a new 10-token prompt: 'long''s last 100 tokens, one
    100-token step and one of 10, each beside 'long''s decode row: 21 + 12 ms."""
    sched = scheduler("slo", max_num_batched_tokens=100)
    sched.policy.clock = Clock(0.0)
    admission = Admission(max_waiting=100)
    for name, arrival, prompt_len, priority in [("long", 0.0, 300, 0), ("late", -10.0, 50, 0),
                                                 ("best", 0.0, 40, BEST_EFFORT_PRIORITY)]:
        request(sched, name, arrival, prompt_len=prompt_len, ttft_ms=1000 if name == "long" else 200,
                priority=priority, first_token=1000 * len(sched.seqs) + 1)
        admission.admit(1, prompt_len)
    decode_step(sched)
    decode_step(sched)
    forecast = sched.forecast()
    assert (forecast.seqs_not_ahead, forecast.prompt_tokens_not_ahead) == (3, 200 + 50 + 40)
    assert forecast.ttft_seconds(admission.waiting_prompt_tokens, 10, admission.num_waiting) == pytest.approx(0.033)
    admission.check_ttft(forecast, prompt_tokens=10, ttft_ms=50)


def test_forecast_adds_half_the_step_in_flight():
    """A request that arrives while a step runs joins the step after it: half a step later on average."""
    forecast = Forecast(FIT, decode_rows=0, prefill_tokens_per_step=2048, step_seconds=0.040)
    assert forecast.ttft_seconds(0, 100) == pytest.approx(0.020 + 0.020)


# FIT and 10 us a token of context a decode row reads
FIT_CONTEXT = StepTimeFit(a=0.010, b=0.001, c=0.0001, d=0.00001)


def test_running_sequences_are_capped_lower_as_their_contexts_grow():
    """A 50 ms decode step (the TPOT target) leaves 40 ms beside the 10 ms every step pays: 40 rows at
    1 ms without context; each row reading 100 tokens costs 2 ms (20 rows), 400 tokens 5 ms (8 rows)."""
    def running_after_one_step(fit: StepTimeFit, prompt_len: int) -> int:
        sched = scheduler("slo", num_blocks=8192, fit=fit, max_num_batched_tokens=16384)
        sched.policy.clock = Clock(0.0)
        for i in range(50):
            request(sched, f"r{i}", arrival=0.001 * i, prompt_len=prompt_len, ttft_ms=1000, tpot_ms=50,
                    first_token=1000 * i + 1)
        decode_step(sched)
        return len(sched.running)

    assert running_after_one_step(FIT, 400) == 40
    assert running_after_one_step(FIT_CONTEXT, 100) == 20
    assert running_after_one_step(FIT_CONTEXT, 400) == 8


@pytest.mark.parametrize("fit, batch_running, batch_rows", [(FIT, 10, 1), (FIT_CONTEXT, 8, 0)])
def test_long_batch_lines_are_held_back_first(fit, batch_running, batch_rows, share_20_percent):
    """Ten batch lines of 301 tokens run; four online requests (4 tokens) arrive. Without the context
    term 14 rows make a 24 ms step, within 50 ms: nothing gives way, and one batch row (1 ms) fits the
    background share (20% of the online decodes' 14 ms step, half in rows: 1.4 ms). Each row reading
    its context, the ten lines alone make a 50.1 ms step: the online requests take the slots of two
    (the first: 10 + 11 + 30.1 ms, then 47.1 with one line out; the second and third fit at 48.2 and
    49.2; the fourth at 50.3, then 46.2 with another line out), all four run at once, and no batch row
    (1 + 3 ms) fits the share: the online rows decode alone."""
    sched = scheduler("slo", fit=fit, max_num_batched_tokens=4096)
    sched.policy.clock = Clock(0.0)
    for i in range(10):
        request(sched, f"b{i}", 0.01 * i, prompt_len=300, priority=BATCH, first_token=1000 * i + 1)
    decode_step(sched)
    for i in range(4):
        request(sched, f"online{i}", 1.0, ttft_ms=200, tpot_ms=50, first_token=100_000 + 10 * i)
    online = {f"online{i}" for i in range(4)}
    assert online <= set(decode_step(sched).seq_ids)
    assert sum(seq.params.priority == BATCH for seq in sched.running) == batch_running
    for _ in range(3):
        out = decode_step(sched)
        assert online <= set(out.seq_ids) and len(out) == 4 + batch_rows
    assert len(sched.waiting) == 10 - batch_running  # the displaced lines wait: no room for them


def test_the_plan_grows_more_conservative_as_the_fit_misses():
    """With the model's steps off by 50% on average the margin is 1 / 1.5: a 33.3 ms decode step holds
    23 rows (FIT), not 40, and the prefill cap beside ten decodes falls from 300 tokens to 133."""
    sched = scheduler("slo")
    sched.policy.clock = Clock(0.0)
    for i in range(10):
        request(sched, f"d{i}", arrival=0.0, ttft_ms=1000, tpot_ms=50, max_tokens=2)
    decode_step(sched)
    sched.policy.begin_step(sched.running)
    assert (sched.policy.max_running(64), sched.policy.cap) == (40, 300)
    sched.step_time.relative_error = 0.5
    sched.policy.begin_step(sched.running)
    assert sched.policy.margin == pytest.approx(1 / 1.5)
    assert (sched.policy.max_running(64), sched.policy.cap) == (23, 133)


def test_forecast_counts_the_context_its_steps_read():
    """Ten online decodes of 5 tokens each (after their first): a decode step of 10 + 10 + 0.5 ms."""
    sched = scheduler("slo", fit=FIT_CONTEXT)
    sched.policy.clock = Clock(0.0)
    for i in range(10):
        request(sched, f"d{i}", arrival=0.0, tpot_ms=50, first_token=10 * i + 1)
    decode_step(sched)
    forecast = sched.forecast()
    assert (forecast.decode_rows, forecast.context_tokens) == (10, 50)
    assert forecast.fit.seconds(forecast.decode_rows, 0, forecast.context_tokens) == pytest.approx(0.0205)


# The H100's online fit beside a batch job: 7.24 ms a step, 1.44 us a decode row, 20.7 us a
# prompt token, 0.072 us a token of context read.
FIT_H100 = StepTimeFit(a=0.00724, b=1.44e-6, c=20.7e-6, d=0.072e-6)


def online_step_beside(num_batch_lines: int) -> tuple[SchedulerOutput, Scheduler]:
    """100 online decodes of 205 tokens, behind their TPOT pace (the prefill cap binds: a 50 ms step,
    ~1,990 prompt tokens of the 4,096 a step may hold), a 2,000-token online prompt waiting, and
    num_batch_lines batch lines of 500 tokens decoding, as many again waiting: the next step."""
    clock = Clock(10.0)
    sched = scheduler("slo", num_blocks=65536, fit=FIT_H100, max_num_seqs=1024, max_num_batched_tokens=4096)
    sched.policy.clock = clock
    lines = [request(sched, f"b{i}", 0.0, prompt_len=500, priority=BATCH, first_token=1_000_000 + 1000 * i)
             for i in range(num_batch_lines)]
    online = [request(sched, f"d{i}", 0.0, prompt_len=200, ttft_ms=200, tpot_ms=50, first_token=1000 * i + 1)
              for i in range(100)]
    for seq in lines + online:  # running, their prompts and first answers computed
        sched._start_running(seq)
        sched.policy.joined(seq)
        seq.token_ids += [7] * (5 if seq in online else 1)
        assert sched.kv.allocate(seq, seq.num_tokens - 1)
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.metrics.first_token_time = 9.0  # 5 tokens in a second: behind a 50 ms pace
    request(sched, "prompt", 10.0, prompt_len=2000, ttft_ms=200, tpot_ms=50, first_token=500_000)
    for i in range(num_batch_lines):
        request(sched, f"w{i}", 0.0, prompt_len=150, priority=BATCH, first_token=2_000_000 + 1000 * i)
    return sched.schedule(), sched


def test_batch_lines_take_only_what_the_online_step_leaves():
    """Beside the batch job the online work plans its step as alone: the waiting online prompt gets the
    same chunk (batch rows no longer shrink the prefill cap), and batch rows and prompt tokens lengthen
    the step by BACKGROUND_SHARE of the online decodes' step at most, not the online decodes' TPOT
    slack."""
    alone, _ = online_step_beside(0)
    beside, sched = online_step_beside(64)
    online_rows = {seq_id: n for seq_id, n in zip(alone.seq_ids, alone.num_new_tokens)}
    assert {seq_id: n for seq_id, n in zip(beside.seq_ids, beside.num_new_tokens) if seq_id in online_rows} \
        == online_rows
    assert online_rows["prompt"] > 1500
    batch_tokens = sum(n for seq_id, n in zip(beside.seq_ids, beside.num_new_tokens) if seq_id not in online_rows)
    assert batch_tokens > 0  # the job still progresses
    online_decode_s = FIT_H100.seconds(100, 0, 100 * 205)
    added_s = FIT_H100.seconds(*step_shape(beside)) - FIT_H100.seconds(*step_shape(alone))
    assert added_s <= slo_policy.BACKGROUND_SHARE * online_decode_s + 1e-9


def test_a_step_refused_ahead_banks_nothing():
    """Under async scheduling the engine asks for a step ahead of the one in flight; refused (here its
    only sequence's token in flight is its last), it asks again once that step is done. The background
    share's prompt tokens are banked once for each step that runs, not for each time one is planned."""
    sched = scheduler("slo")
    sched.policy.clock = Clock(0.0)
    seq = request(sched, "online", arrival=0.0, ttft_ms=1000, tpot_ms=50, max_tokens=2)
    decode_step(sched)  # its prompt computed, its first token out
    banked = sched.policy.prompt_bank.tokens
    assert sched.schedule(in_flight=[seq]) is None
    assert sched.policy.prompt_bank.tokens == banked
    sched.schedule()
    # 10% of its 11 ms decode step, half of it in prompt tokens at 0.1 ms: 5.5 tokens
    assert sched.policy.prompt_bank.tokens == pytest.approx(banked + 5.5)
