"""Lookahead decoding (engine/spec_decode/lookahead.py): the pool of the target's own predictions,
hand-computed, and greedy outputs unchanged with it on the embedded model."""

from __future__ import annotations

from goodserve import LLM, SamplingParams
from goodserve.engine.spec_decode.acceptance import window_samples
from goodserve.engine.spec_decode.lookahead import harvest, propose_from_pool
from tests.test_spec_decode import COPY, OTHERS


def test_window_samples_are_every_position_of_each_verifying_row():
    sampled = [10, 11, 99, 13, 7, 20, 21, 22, 5]  # rows of 4, 1 (no drafts) and 4 positions
    assert window_samples(sampled, [[10, 11, 12], [], [20, 21, 22]]) == {0: [10, 11, 99, 13], 2: [20, 21, 22, 5]}


def test_the_pool_keeps_predictions_past_a_rejection_and_chains_them():
    pool: dict = {}
    # The sequence ends ... 4, 5; drafts 6, 7 verified: the target wrote 6 after 5, then 8 (not 7)
    # after 6, then 9 after the rejected 7.
    harvest(pool, before=4, window=[5, 6, 7], predicted=[6, 8, 9])
    assert pool == {(4, 5): 6, (5,): 6, (5, 6): 8, (6,): 8, (6, 7): 9, (7,): 9}
    assert propose_from_pool(pool, [1, 4, 5], 4) == [6, 8]  # 5 -> 6, (5, 6) -> 8, then nothing after 8
    assert propose_from_pool(pool, [3, 7], 2) == [9]  # (3, 7) unknown: (7,) -> 9
    assert propose_from_pool(pool, [4, 5], 1) == [6] and propose_from_pool(pool, [2, 3], 4) == []


def _tokens(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def test_greedy_is_identical_and_the_pool_proposes(embedded_llm):
    """With prompt lookup of 2 tokens or more (1 nearly always matches something), the pool
    proposes where lookup finds nothing: lookahead drafts and keeps more than prompt lookup alone
    (62 and 35 tokens against 53 and 32), with the same outputs."""
    prompts = [COPY, *OTHERS]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 48, 33, 24)]
    expected = _tokens(embedded_llm.generate(prompts, params))
    counts = {}
    for method in ("ngram", "lookahead"):
        llm = LLM("smollm2-135m", quantization="none", cpu_kv_cache_bytes=64 << 20, speculative_method=method,
                  num_speculative_tokens=4, ngram_min=2, spec_min_acceptance=0)
        assert _tokens(llm.generate(prompts, params)) == expected  # a mixed batch
        stats = llm.engine.stats()
        assert _tokens(llm.generate(prompts[1:2], params[1])) == expected[1:2]  # alone
        counts[method] = (stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens)
        assert llm.engine.kv.num_used_blocks == 0
    assert counts["lookahead"][0] > counts["ngram"][0] and counts["lookahead"][1] > counts["ngram"][1]
