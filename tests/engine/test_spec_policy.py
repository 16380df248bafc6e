"""The speculation policy (engine/spec_decode/policy.py) on scripted acceptance histories: it decides
per step from the batch size and each sequence's measured acceptance against a fixed cost table, and
probes the sequences it left out in a bounded share of steps."""

from goodserve import LLM
from goodserve.config import EngineConfig
from goodserve.engine.core.sequence import Sequence
from goodserve.engine.spec_decode.policy import (EAGER_COST, GRAPHED_COST, NATIVE_DECODE_COST, NATIVE_SPLIT_COST,
                                                PROBE_EVERY, Speculator)
from goodserve.engine.seam.drafts import Branch, Drafts
from goodserve.engine.seam.runner_output import ModelRunnerOutput
from goodserve.engine.seam.scheduler_output import SchedulerOutput
from goodserve.sampling_params import SamplingParams
from helpers import loaded_model

K = 4


class _Proposer:
    """Proposes all k it is asked for (what they are does not matter here: the history is scripted)."""

    def propose(self, wanted):
        return [Drafts([0] * r.k) for r in wanted]


def _speculator(cost=GRAPHED_COST, **options) -> Speculator:
    config = EngineConfig(model="dummy:tiny", **{"speculative_method": "ngram", "num_speculative_tokens": K, **options})
    return Speculator(config, _Proposer(), cost=cost)


def _seqs(n: int) -> list[Sequence]:
    return [Sequence(f"s{i}", f"s{i}", 0, [1, 2, 3], 3, SamplingParams(), 4096) for i in range(n)]


def _step(seqs: list[Sequence]) -> SchedulerOutput:
    """A step of decodes, one row a sequence."""
    return SchedulerOutput(seq_ids=[seq.seq_id for seq in seqs], samples=[True] * len(seqs))


def _steps(speculator: Speculator, seqs: list[Sequence], steps: int, accepts) -> list[tuple[dict, dict]]:
    """Each step as the engine takes it: counted, carrying the drafts proposed after the step before,
    its plan for the next one made with it; once computed, its verifications observed (accepts(step,
    k): drafts kept of k), then the next step's drafts proposed. Returns, per step, its plan (the
    sequences it planned drafts for: the next step waits for its tokens) and the drafts proposed for
    the next step, each by sequence id."""
    found = []
    for step in range(steps):
        speculator.counted_step()
        out = _step(seqs)
        out.draft_token_ids = {row: drafts.token_ids for row, seq in enumerate(seqs)
                               if (drafts := speculator.drafts_for_step(seq, K))}
        out.num_next_drafts = speculator.plan_next(seqs, out, len(seqs))
        for row, drafts in out.draft_token_ids.items():
            speculator.observe(seqs[row], len(drafts), accepts(step, len(drafts)))
        speculator.propose_next(out, ModelRunnerOutput([], []), {seq.seq_id: seq for seq in seqs}, len(seqs))
        found.append(({seqs[row].seq_id: k for row, k in out.num_next_drafts.items()},
                      {seq_id: len(drafts.token_ids) for seq_id, drafts in speculator.pending.items()}))
    return found


def _run(speculator: Speculator, seqs: list[Sequence], steps: int, accepts) -> list[dict[str, int]]:
    """Per step, the drafts proposed for the next one, by sequence id (_steps)."""
    return [drafted for _, drafted in _steps(speculator, seqs, steps, accepts)]


def test_low_acceptance_stops_drafting_but_for_bounded_probes_which_notice_a_later_copy():
    speculator, seqs = _speculator(), _seqs(4)
    plans = _run(speculator, seqs, 10 * PROBE_EVERY + PROBE_EVERY // 2, lambda step, k: 0)
    drafting = [step for step, plan in enumerate(plans) if plan]
    first = [step for step in drafting if step < PROBE_EVERY]
    assert 0 < len(first) <= 5  # the unmeasured sequences try, then stop
    probes = drafting[len(first):]
    assert len(probes) <= 10 and all(b - a >= PROBE_EVERY for a, b in zip(probes, probes[1:]))
    # The text turns copyable: the next probe measures it, and every step from the one after it drafts
    # k = K (the drafts after the probe's step follow the plan made again once its drafts were judged).
    plans = _run(speculator, seqs, 2 * PROBE_EVERY, lambda step, k: k)
    start = next(step for step, plan in enumerate(plans) if plan)
    assert start <= PROBE_EVERY and all(plan == {seq.seq_id: K for seq in seqs} for plan in plans[start:])


class _NoMatch:
    """An n-gram proposer on text that never repeats: nothing to propose."""

    def propose(self, wanted):
        return [Drafts([]) for _ in wanted]


def test_sequences_whose_drafts_are_never_found_leave_the_plan_but_for_probes():
    """Without the misses counted, a sequence keeps its starting estimate and stays in every plan,
    and no step may run ahead (ShareGPT-like text on the H100 ran 0.91x of speculation off)."""
    config = EngineConfig(model="dummy:tiny", speculative_method="ngram", num_speculative_tokens=K)
    speculator, seqs = Speculator(config, _NoMatch(), cost=GRAPHED_COST), _seqs(2)
    plans = _steps(speculator, seqs, 4 * PROBE_EVERY, lambda step, k: 0)
    planned = [step for step, (plan, _) in enumerate(plans) if plan]
    assert len(planned) <= 4 + 4 and planned[-1] >= PROBE_EVERY  # a few tries, then the probes alone


def test_high_acceptance_at_batch_one_drafts_every_step():
    plans = _run(_speculator(), _seqs(1), 50, lambda step, k: k)
    assert all(plan == {"s0": K} for plan in plans)


def test_large_batches_draft_nothing():
    """Over spec_max_batch nothing drafts whatever the acceptance; under it, eagerly (a token costs
    about 6% of a one-token step) a batch of 8 at acceptance 0.25 does not pay, one sequence does;
    lookahead's window counts in the cost."""
    assert not any(_run(_speculator(spec_max_batch=8), _seqs(9), 20, lambda step, k: k))
    seqs = _seqs(8)
    for seq in seqs:
        seq.spec_acceptance = 0.25
    speculator = _speculator(EAGER_COST)
    assert speculator.plan(seqs, 8) == {}
    assert list(speculator.plan(seqs[:1], 1)) == ["s0"]
    assert _speculator(EAGER_COST, speculative_method="lookahead").plan(seqs[:1], 1) == {}


def test_the_always_policy_drafts_for_every_sequence_under_the_batch_bound():
    seqs = _seqs(3)
    seqs[0].spec_acceptance = 0.0
    assert _speculator(spec_policy="always").plan(seqs, 3) == dict.fromkeys(("s0", "s1", "s2"), K)


def test_drafting_must_pay_a_verify_step_off_the_native_decode_stack():
    """At acceptance 0.4 two drafts add 0.4 + 0.16 = 0.56 tokens: worth a per-op verify step (EAGER_COST:
    1.11 decode steps, 1.56 / 1.11 = 1.40x, more than four drafts' 1.65 / 1.22 = 1.35x), not one off the
    CPU's native decode stack (one draft: 1.4 tokens for 1 + 0.61 + 0.36 = 1.97 steps, 0.71x; more do
    worse). At 0.95 four drafts add 3.52: 4.52 tokens for 1 + 0.61 + 4 x 0.36 = 3.05 steps there, 1.48x.
    Verify rows on the native stack (NATIVE_SPLIT_COST) at 0.4: one draft 1.4 tokens for 1 - 0.25 + 0.31 =
    1.06 steps (1.32x), two 1.56 for 1.37 (1.14x); at 0.95 four, 4.52 for 1.99 (2.27x against three's 2.21x)."""
    cases = ((0.4, {"s0": 2}, {}, {"s0": 1}), (0.95, {"s0": K}, {"s0": K}, {"s0": K}))
    for acceptance, per_op, native, split in cases:
        for cost, plan in ((EAGER_COST, per_op), (NATIVE_DECODE_COST, native), (NATIVE_SPLIT_COST, split)):
            seqs = _seqs(1)
            seqs[0].spec_acceptance = acceptance
            assert _speculator(cost).plan(seqs, 1) == plan, (acceptance, cost)


def test_the_cost_table_follows_the_path_decode_steps_take():
    """An int4 model on the CPU decodes on the native stack; its verify steps run there as one-token
    rows (cpu_spec_decode_verify_split.json: 1.1-2.1x a decode step at batch 1), lookahead's leave
    it for the per-op path (cpu_spec_decode_verify.json: 2.2-3x)."""
    options = dict(speculative_method="ngram", num_speculative_tokens=K, num_kv_blocks=64)
    native = LLM("dummy:tiny", quantization="int4", quantization_group_size=32, **options).engine
    assert loaded_model(native).native_decode is not None
    assert native.scheduler.speculator.cost is NATIVE_SPLIT_COST
    lookahead = {**options, "speculative_method": "lookahead"}
    native = LLM("dummy:tiny", quantization="int4", quantization_group_size=32, **lookahead).engine
    assert native.scheduler.speculator.cost is NATIVE_DECODE_COST
    assert LLM("dummy:tiny", **options).engine.scheduler.speculator.cost is EAGER_COST


def test_probes_come_less_often_where_a_probe_step_is_dear():
    """A probe's step costs ratio - 1 plain steps more: 0.16 on the graphed table and 0.22 on the CPU's
    per-op one (one in 32 steps), 0.61 + 4 x 0.36 = 2.05 off the native decode stack (one in 66), and
    with lookahead's 2 x 2 window there 0.61 + 8 x 0.36 = 3.49 (one in 112): about 1/32 of the run."""
    assert _speculator(GRAPHED_COST).probe_every == PROBE_EVERY == 32
    assert _speculator(EAGER_COST).probe_every == PROBE_EVERY
    native = _speculator(NATIVE_DECODE_COST)
    assert native.probe_every == 66
    seqs = _seqs(1)
    plans = _run(native, seqs, 3 * 66, lambda step, k: 0)
    probes = [step for step, plan in enumerate(plans) if plan and step > 66]  # after the first tries
    assert probes and all(b - a >= 66 for a, b in zip(probes, probes[1:]))
    assert _speculator(NATIVE_DECODE_COST, speculative_method="lookahead", lookahead_window=2,
                       lookahead_ngram=3).probe_every == 112


class _BranchingProposer:
    """Drafts of 5s, and a side branch."""

    def propose(self, wanted):
        return [Drafts([5] * r.k, branch=Branch([7], [-1], [0])) for r in wanted]

    def release(self, seq_id):
        pass


def test_a_step_takes_of_the_drafts_proposed_after_the_last_what_its_budget_leaves_room_for():
    """A step plans the next (a k per sampling row, no more than its sequence may write after the
    step's token); once it is computed the drafts are proposed, by the host proposer or the
    runner's drafter (its output's spec_token_ids); the next step takes their first ones (and a
    lookahead branch), as many as its budget and the sequence's length leave room for, none without
    room, none once the sequence has left."""
    config = EngineConfig(model="dummy:tiny", speculative_method="ngram", num_speculative_tokens=K,
                          spec_policy="always")
    drafter = ModelRunnerOutput([0, 1], [[9], [9]], spec_token_ids={0: [5] * K, 1: [5, 5]})
    for proposer, output in ((_BranchingProposer(), ModelRunnerOutput([0, 1], [[9], [9]])), (None, drafter)):
        speculator, (seq, short) = Speculator(config, proposer, cost=GRAPHED_COST), _seqs(2)
        short.params = SamplingParams(max_tokens=3)  # this step's token, then the next step's and a draft
        out = _step([seq, short])
        out.num_next_drafts = speculator.plan_next([seq, short], out, 2)
        assert out.num_next_drafts == {0: K, 1: 1}
        for s in (seq, short):
            s.token_ids.append(9)  # the step's token
        speculator.propose_next(out, output, {s.seq_id: s for s in (seq, short)}, 2)
        whole = speculator.drafts_for_step(seq, K + 3)
        assert whole.token_ids == [5] * K and (whole.branch is not None) == (proposer is not None)
        part = speculator.drafts_for_step(seq, 2)
        assert part.token_ids == [5, 5] and part.branch is whole.branch
        assert speculator.drafts_for_step(seq, 0) is None
        assert speculator.drafts_for_step(short, K).token_ids == [5]
        speculator.release(seq)
        assert speculator.drafts_for_step(seq, K) is None
