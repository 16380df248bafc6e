"""Speculative decoding (engine/spec_decode/): the n-gram proposer, the exact verifier, rollback.

Greedy outputs with speculation are token-for-token those without it (embedded_llm, speculation off,
is the reference), alone, in mixed batches, with chunked prefill and prefix-cache hits; the
acceptance rule keeps the target distribution (chi-square over seeded draws); no block leaks."""

from __future__ import annotations

import random

import pytest
import torch

from goodserve import LLM, SamplingParams
from goodserve.engine.worker.model_inputs import FlatBatch, as_one_token_rows
from goodserve.engine.seam.drafts import DraftRequest
from goodserve.engine.spec_decode.acceptance import kept_tokens
from goodserve.engine.spec_decode.ngram import NgramProposer, propose_ngram
from goodserve.ops.kernel_choice import KernelChoice
from goodserve.ops.sampler import SamplingBatch, sample

PASSAGE = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single "
           "step. To be or not to be, that is the question.")
COPY = f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}\n\n{PASSAGE[:40]}"
OTHERS = ["Once upon a time", "def fibonacci(n):\n", "The capital of France is"]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def _spec_llm(**options) -> LLM:
    return LLM("smollm2-135m", quantization="none", cpu_kv_cache_bytes=64 << 20, speculative_method="ngram",
               num_speculative_tokens=4, **options)


@pytest.fixture(scope="module")
def spec_llm():
    return _spec_llm()


def _tokens(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


# ---- the proposer and the acceptance rule --------------------------------------------------------
def test_ngram_proposes_what_followed_the_longest_latest_match():
    assert propose_ngram([1, 2, 3, 4, 5, 9, 2, 3], 1, 3, 2) == [4, 5]
    assert propose_ngram([7, 3, 8, 1, 3, 9, 3], 1, 3, 5) == [9, 3]  # the latest occurrence of [3]
    assert propose_ngram([1, 2, 3, 1, 2], 2, 2, 4) == [3, 1, 2]
    assert propose_ngram([5, 6, 7], 1, 2, 3) == []  # no earlier occurrence
    assert propose_ngram([1, 2, 1], 2, 3, 3) == []  # shorter than ngram_min matches only


def _ngram_by_brute_force(ids: list[int], ngram_min: int, ngram_max: int, k: int) -> list[int]:
    for n in range(min(ngram_max, len(ids) - 1), ngram_min - 1, -1):
        for start in range(len(ids) - 1 - n, -1, -1):  # latest first, ending before the last token
            if ids[start : start + n] == ids[-n:]:
                return ids[start + n : start + n + k]
    return []


def test_ngram_lookup_and_its_proposer_agree_with_a_brute_force_scan():
    """Random short sequences over tiny vocabularies (many overlapping matches); the proposer fed
    a sequence growing a token at a time, then another under the same id after a release."""
    rng = random.Random(0)
    for _ in range(3000):
        ids = [rng.randrange(rng.randint(1, 6)) for _ in range(rng.randint(1, 40))]
        ngram_min = rng.randint(1, 4)
        ngram_max, k = rng.randint(ngram_min, 5), rng.randint(1, 5)
        assert propose_ngram(ids, ngram_min, ngram_max, k) == _ngram_by_brute_force(ids, ngram_min, ngram_max, k)
    proposer, ids = NgramProposer(1, 4), []
    for token in [rng.randrange(4) for _ in range(600)]:  # past the array's first capacity
        ids.append(token)
        assert proposer.propose([DraftRequest("s", ids, 3)])[0].token_ids == _ngram_by_brute_force(ids, 1, 4, 3)
    proposer.release("s")
    other = [3, 1, 2, 3, 1]
    assert proposer.propose([DraftRequest("s", other, 3)])[0].token_ids == [2, 3, 1]


def test_kept_tokens_are_the_confirmed_drafts_then_the_targets_token():
    sampled = [10, 11, 99, 13, 7, 20, 21, 22, 5]  # 4 positions, 1, 4
    assert kept_tokens(sampled, [[10, 11, 12], [], [20, 21, 22]]) == [[10, 11, 99], [7], [20, 21, 22, 5]]


def test_rejection_keeps_the_target_distribution():
    """Point-mass drafts d0, d1 verified over 3 positions of a 6-token vocabulary: the first kept token
    follows p0, the second (after d0 was kept) follows p1, d0 is kept with probability p0(d0)."""
    torch.manual_seed(0)
    vocab, draws, drafts = 6, 40_000, [2, 4]
    logits = torch.tensor([[1.0, 0.2, 0.5, -1.0, 0.0, 0.7], [0.3, -0.5, 1.2, 0.0, 0.9, -2.0], [0.0] * vocab])
    rows = 3 * draws
    batch = SamplingBatch(temperature=torch.ones(rows), top_k=torch.full((rows,), vocab), top_p=torch.ones(rows),
                          min_p=torch.zeros(rows), generators=[None] * rows, needs_top_k_p=False)
    sampled = sample(logits.repeat(draws, 1), batch, KernelChoice()).token_ids.tolist()
    kept = kept_tokens(sampled, [drafts] * draws)
    p0, p1, _ = logits.softmax(-1)
    first = torch.bincount(torch.tensor([row[0] for row in kept]), minlength=vocab).double()
    second = torch.bincount(torch.tensor([row[1] for row in kept if row[0] == drafts[0]]), minlength=vocab).double()
    chi_square_5_dof_p001 = 20.52
    for counts, p in ((first, p0), (second, p1)):
        expected = counts.sum() * p.double()
        assert ((counts - expected) ** 2 / expected).sum() < chi_square_5_dof_p001
    assert abs(first[drafts[0]] / draws - p0[drafts[0]]) < 0.01


# ---- exactness in the engine ---------------------------------------------------------------------
def test_greedy_alone_is_identical_and_drafts_are_accepted(embedded_llm, spec_llm):
    before = spec_llm.engine.stats()
    assert _tokens(spec_llm.generate([COPY], GREEDY)) == _tokens(embedded_llm.generate([COPY], GREEDY))
    stats = spec_llm.engine.stats()
    drafted = stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert drafted > 0 and 0 < accepted <= drafted
    assert spec_llm.engine.kv.num_used_blocks == 0


@pytest.mark.slow  # the fast tier keeps speculation's greedy identity alone (above)
def test_greedy_mixed_batch_is_identical(embedded_llm, spec_llm):
    prompts = [COPY, *OTHERS, COPY + " jumps"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 25, 33, 12, 30)]
    assert _tokens(spec_llm.generate(prompts, params)) == _tokens(embedded_llm.generate(prompts, params))


@pytest.mark.slow  # the fast tier has speculation's greedy identity alone and in a mixed batch
def test_greedy_with_chunked_prefill_and_prefix_hits_is_identical(embedded_llm):
    """A small token budget chunks the prompts and cuts drafts short; the second round hits the
    prefix cache (including blocks that hold kept drafts)."""
    check_chunked_and_prefix_hits(_spec_llm(max_num_batched_tokens=24), embedded_llm, [COPY, OTHERS[0], COPY], GREEDY)


def check_chunked_and_prefix_hits(llm, embedded_llm, prompts: list[str], params: SamplingParams) -> None:
    """Greedy tokens as the plain engine's, twice: the second round hits the prefix cache."""
    expected = _tokens(embedded_llm.generate(prompts, params))
    assert _tokens(llm.generate(prompts, params)) == expected
    hits = llm.engine.stats().prefix_cache_hits
    assert _tokens(llm.generate(prompts, params)) == expected
    assert llm.engine.stats().prefix_cache_hits > hits
    assert llm.engine.kv.num_used_blocks == 0


@pytest.mark.slow  # a second speculating engine's worth of requests; the fast tier keeps greedy identity
def test_sampling_features_keep_working(embedded_llm, spec_llm):
    """Seeds (the same tokens as without speculation), penalties, min_tokens, stop strings, stop
    tokens, max_tokens and logprobs per kept token."""
    cases = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=60, ignore_eos=True),
        SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.2, max_tokens=30),
        SamplingParams(temperature=0, min_tokens=20, max_tokens=30),
        SamplingParams(temperature=0, stop=["thousand"], max_tokens=60),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, logprobs=2, max_tokens=30, ignore_eos=True),
    ]
    ours, ref = spec_llm.generate([COPY] * len(cases), cases), embedded_llm.generate([COPY] * len(cases), cases)
    for mine, theirs in zip(ours, ref):
        a, b = mine.outputs[0], theirs.outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (b.token_ids, b.text, b.finish_reason,
                                                                       b.stop_reason)
    mine, theirs = ours[-1].outputs[0], ref[-1].outputs[0]
    assert len(mine.logprobs) == len(mine.token_ids)
    for entry, other, token in zip(mine.logprobs, theirs.logprobs, mine.token_ids):
        assert entry.keys() == other.keys() and entry[token].logprob == pytest.approx(other[token].logprob, abs=1e-4)
    assert spec_llm.engine.stats().spec_decode_num_accepted_tokens > 0


def abort_mid_speculation(engine, prompts: list[str], max_steps: int) -> None:
    """Step the prompts until drafts were made with all of them running, abort them all: no request
    is left and no block is held."""
    drafted = engine.stats().spec_decode_num_draft_tokens
    for i, prompt in enumerate(prompts):
        engine.add_request(f"abort-{i}", prompt, GREEDY)
    for _ in range(max_steps):
        engine.step()
        if engine.stats().spec_decode_num_draft_tokens > drafted and engine.stats().num_running == len(prompts):
            break
    assert engine.stats().spec_decode_num_draft_tokens > drafted and engine.kv.num_used_blocks > 0
    for i in range(len(prompts)):
        engine.abort_request(f"abort-{i}")
    assert not engine.has_unfinished() and engine.kv.num_used_blocks == 0


def test_abort_mid_speculation_leaks_no_blocks(spec_llm):
    abort_mid_speculation(spec_llm.engine, [COPY, COPY + " jumps", OTHERS[1]], max_steps=20)


@pytest.mark.slow  # an engine of its own; the fast tier keeps speculation's greedy identity
def test_no_drafts_above_the_batch_bound():
    llm = _spec_llm(spec_max_batch=2)
    llm.generate([COPY] * 3, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert llm.engine.stats().spec_decode_num_draft_tokens == 0


def test_metrics_serve_the_counters(spec_llm):
    from goodserve.server.metrics import EngineStatsCollector

    spec_llm.generate([COPY], GREEDY)
    samples = [s for family in EngineStatsCollector(spec_llm.engine, "m").collect() for s in family.samples]
    totals = {s.name: s.value for s in samples}
    drafts = totals["goodserve:spec_decode_num_draft_tokens_total"]
    accepted = totals["goodserve:spec_decode_num_accepted_tokens_total"]
    assert 0 < totals["goodserve:spec_decode_num_drafts_total"] <= drafts and 0 < accepted <= drafts
    per_pos = [s.value for s in samples if s.name == "goodserve:spec_decode_num_accepted_tokens_per_pos_total"]
    assert len(per_pos) == spec_llm.engine.config.num_speculative_tokens and sum(per_pos) == accepted


# ---- verify steps on the CPU's native decode stack ----------------------------------------------
def test_short_rows_become_one_token_rows_over_their_block_tables():
    flat = FlatBatch(input_ids=[5, 6, 7, 8, 9, 10], positions=[40, 41, 42, 43, 7, 8], slots=[0, 1, 2, 3, 4, 5],
                     query_lens=[1, 3, 2], seq_lens=[41, 44, 9], block_tables=[[1], [2, 3], [4]],
                     sample_rows=[0, 1, 2], logits_indices=[0, 1, 2, 3, 5], prompt_logit_spans={})
    split = as_one_token_rows(flat)
    assert split.query_lens == [1] * 6 and split.seq_lens == [41, 42, 43, 44, 8, 9]
    assert split.block_tables == [[1], [2, 3], [2, 3], [2, 3], [4], [4]]
    assert (split.input_ids, split.slots, split.logits_indices) == (flat.input_ids, flat.slots, flat.logits_indices)
    long_row = FlatBatch([0] * 10, list(range(10)), list(range(10)), [1, 9], [5, 9], [[0], [1]], [0, 1], [0, 9], {})
    assert as_one_token_rows(long_row) is long_row  # a prompt: one prefill row


@pytest.mark.slow  # a GGUF engine of its own; the fast tier checks the verify rows' shape (test above)
def test_verify_steps_run_the_native_decode_stack_with_the_plain_decode_tokens(monkeypatch, embedded_gguf_llm):
    """On the CPU default (gguf codes), a verify step's rows go through the one native call as
    decode rows, so each position's logits are a plain decode step's: greedy tokens identical."""
    from goodserve.model.native_decode import NativeDecodeStack

    plain = embedded_gguf_llm
    spec = LLM("smollm2-135m", cpu_kv_cache_bytes=64 << 20, speculative_method="ngram", num_speculative_tokens=4,
               spec_policy="always")
    rows_per_call, call = [], NativeDecodeStack.__call__
    monkeypatch.setattr(NativeDecodeStack, "__call__", lambda self, x, *args: rows_per_call.append(x.shape[0])
                        or call(self, x, *args))
    prompts = [COPY, OTHERS[1]]
    assert _tokens(spec.generate(prompts, GREEDY)) == _tokens(plain.generate(prompts, GREEDY))
    stats = spec.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert max(rows_per_call) > len(prompts)  # verify steps: a row a token and draft
    assert spec.engine.kv.num_used_blocks == 0
