"""The speculation policy (engine/spec_decode/policy.py) on scripted acceptance histories: it decides
per step from the batch size and each sequence's measured acceptance against a fixed cost table, and
probes the sequences it left out in a bounded share of steps."""

from goodserve.config import EngineConfig
from goodserve.engine.sequence import Sequence
from goodserve.engine.spec_decode.policy import EAGER_COST, GRAPHED_COST, PROBE_EVERY, Speculator
from goodserve.engine.spec_decode.proposer import Drafts
from goodserve.sampling_params import SamplingParams

K = 4


class _Proposer:
    """Proposes all k it is asked for (what they are does not matter here: the history is scripted)."""

    def propose(self, wanted):
        return [Drafts([0] * k) for _, k in wanted]


def _speculator(cost=GRAPHED_COST, **options) -> Speculator:
    config = EngineConfig(model="dummy:tiny", **{"speculative_method": "ngram", "num_speculative_tokens": K, **options})
    return Speculator(config, _Proposer(), cost=cost)


def _seqs(n: int) -> list[Sequence]:
    return [Sequence(f"s{i}", f"s{i}", 0, [1, 2, 3], 3, SamplingParams(), 4096) for i in range(n)]


def _run(speculator: Speculator, seqs: list[Sequence], steps: int, accepts) -> list[dict[str, int]]:
    """Each step as the scheduler takes it: the plan, the proposals, the step counted, the
    verifications observed (accepts(step, k): drafts kept of k)."""
    plans = []
    for step in range(steps):
        plan = speculator.plan(seqs, len(seqs))
        proposed = speculator.propose([(seq, plan[seq.seq_id]) for seq in seqs if seq.seq_id in plan]) if plan else {}
        speculator.counted_step()
        for seq in seqs:
            if seq.seq_id in proposed:
                k = len(proposed[seq.seq_id].token_ids)
                speculator.observe(seq, k, accepts(step, k))
        plans.append(plan)
    return plans


def test_low_acceptance_stops_drafting_but_for_bounded_probes_which_notice_a_later_copy():
    speculator, seqs = _speculator(), _seqs(4)
    plans = _run(speculator, seqs, 10 * PROBE_EVERY, lambda step, k: 0)
    drafting = [step for step, plan in enumerate(plans) if plan]
    first = [step for step in drafting if step < PROBE_EVERY]
    assert 0 < len(first) <= 5  # the unmeasured sequences try, then stop
    probes = drafting[len(first):]
    assert len(probes) <= 10 and all(b - a >= PROBE_EVERY for a, b in zip(probes, probes[1:]))
    # The text turns copyable: the next probe measures it, and every step after it drafts k = K.
    plans = _run(speculator, seqs, 2 * PROBE_EVERY, lambda step, k: k)
    start = next(step for step, plan in enumerate(plans) if plan)
    assert start <= PROBE_EVERY and all(plan == {seq.seq_id: K for seq in seqs} for plan in plans[start + 2:])


class _NoMatch:
    """An n-gram proposer on text that never repeats: nothing to propose."""

    def propose(self, wanted):
        return [Drafts([]) for _ in wanted]


def test_sequences_whose_drafts_are_never_found_leave_the_plan_but_for_probes():
    """Without the misses counted, a sequence keeps its starting estimate and stays in every plan,
    and no step may run ahead (ShareGPT-like text on the H100 ran 0.91x of speculation off)."""
    config = EngineConfig(model="dummy:tiny", speculative_method="ngram", num_speculative_tokens=K)
    speculator, seqs = Speculator(config, _NoMatch(), cost=GRAPHED_COST), _seqs(2)
    plans = _run(speculator, seqs, 4 * PROBE_EVERY, lambda step, k: 0)
    planned = [step for step, plan in enumerate(plans) if plan]
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
