"""Lookahead decoding (engine/spec_decode/lookahead.py, ops/tree_attention.py): the window's tree and
the pool, hand-computed; the side branch's masked attention against plain causal attention over each
branch token's own path; greedy outputs token-for-token those of speculation off (the embedded model
and dummy:tiny), alone, in mixed batches, with chunked prefill and prefix hits; sampling exact through
the verifier; no block leaks after aborts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from goodserve import LLM, SamplingParams
from goodserve.engine.spec_decode.lookahead import learn_ngram, learn_verified, propose_from_pool, window_branch
from goodserve.ops.rotary import apply_rotary_torch, cos_sin_cache
from goodserve.ops.tree_attention import BranchTree, as_cached, branch_attention, tree_depths, tree_mask
from helpers import proposer_of
from test_spec_decode import COPY, OTHERS, abort_mid_speculation, check_chunked_and_prefix_hits

CHAT = ["What are three tips for staying healthy?", "Why is the sky blue?"]


def _tokens(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def _lookahead_llm(model: str = "smollm2-135m", **options) -> LLM:
    options = {"quantization": "none", "cpu_kv_cache_bytes": 64 << 20, **options}
    return LLM(model, speculative_method="lookahead", num_speculative_tokens=4, spec_policy="always", **options)


@pytest.fixture(scope="module")
def lookahead_llm():
    return _lookahead_llm()


# ---- the window and the pool ---------------------------------------------------------------------
def test_window_is_a_chain_then_columns():
    branch = window_branch([[10, 11, 12], [20, 21, 22]])
    assert branch.token_ids == [10, 11, 12, 20, 21, 22]
    assert branch.parents == [-1, 0, 1, 0, 1, 2] and branch.logit_rows == [3, 4, 5]
    # level 1's column i stands one after level 0's: x_0, level0[0..i], level1[i] are consecutive
    assert tree_depths(branch.parents) == [1, 2, 3, 2, 3, 4]
    assert tree_mask(branch.parents)[4].tolist() == [True, True, False, False, True, False]


def test_the_pool_chains_the_latest_predictions():
    pool: dict = {}
    learn_ngram(pool, [4, 5, 6, 8])  # 6 after (4, 5) and 5; 8 after (5, 6) and 6
    assert pool == {(4, 5): 6, (5,): 6, (5, 6): 8, (6,): 8}
    assert propose_from_pool(pool, [1, 4, 5], 4) == [6, 8]
    assert propose_from_pool(pool, [3, 6], 2) == [8] and propose_from_pool(pool, [2, 3], 4) == []
    # a verify window: last tokens 4, 5; drafts 6, 7; the target wrote 6, then 9 (not 7), then 1
    learn_verified(pool, [4, 5], [6, 7], [6, 9, 1])
    assert pool[(5, 6)] == 9 and pool[(6, 7)] == 1 and pool[(7,)] == 1


# ---- the side branch's attention -----------------------------------------------------------------
def _causal(q, k, v, scale):
    """q [1, H, D] the last position of k, v [L, Hk, D]: plain attention over all of them."""
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=scale,
                                          enable_gqa=True).transpose(0, 1)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_branch_attention_is_causal_attention_over_each_tokens_path(kv_dtype):
    """Each branch token attends exactly the context and its own ancestors, at their positions:
    the same as plain causal attention over the sequence context + its path, its K/V as cached."""
    torch.manual_seed(0)
    heads, kv_heads, dim, context_len, scale = 4, 2, 16, 7, 0.25
    parents = window_branch([[0, 0, 0], [0, 0, 0], [0, 0, 0]]).parents
    n = len(parents)
    ctx_k, ctx_v = torch.randn(context_len, kv_heads, dim), torch.randn(context_len, kv_heads, dim)
    q, k, v = torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    positions = torch.tensor([context_len - 1 + d for d in tree_depths(parents)])
    table = cos_sin_cache(dim, 64, 10000.0, None)
    q, k = apply_rotary_torch(q, k, positions, table)
    pool = torch.empty(1, 1, kv_heads, dim, dtype=kv_dtype)
    k, v = as_cached(k, pool), as_cached(v, pool)
    tree = BranchTree(0, 0, n, context_len, tree_mask(parents))
    got = branch_attention(q, k, v, [ctx_k], [ctx_v], [tree], scale)
    for i in range(n):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        assert positions[path].tolist() == list(range(context_len, context_len + len(path)))
        expected = _causal(q[i : i + 1], torch.cat([ctx_k, k[path]]), torch.cat([ctx_v, v[path]]), scale)
        torch.testing.assert_close(got[i : i + 1], expected)


def test_as_cached_rounds_as_the_int8_cache_does():
    from goodserve.ops.attention import quantize_int8_per_head

    x = torch.randn(5, 2, 16)
    values, scale = quantize_int8_per_head(x)
    pool = torch.empty(1, 1, 2, 16, dtype=torch.int8)
    torch.testing.assert_close(as_cached(x, pool), values.float() * scale.unsqueeze(-1))


# ---- the engine ----------------------------------------------------------------------------------
@pytest.mark.slow  # the fast tier keeps the n-gram proposer's greedy identity (test_spec_decode.py)
@pytest.mark.parametrize("prompt", CHAT[:2])
def test_greedy_alone_is_identical_and_the_window_drafts(embedded_llm, lookahead_llm, prompt):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    before = lookahead_llm.engine.stats()
    messages = [{"role": "user", "content": prompt}]
    assert _tokens(lookahead_llm.chat(messages, params)) == _tokens(embedded_llm.chat(messages, params))
    stats = lookahead_llm.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > before.spec_decode_num_accepted_tokens
    assert lookahead_llm.engine.kv.num_used_blocks == 0


@pytest.mark.slow  # the fast tier keeps lookahead's greedy identity alone
def test_greedy_mixed_batch_with_plain_requests_is_identical(embedded_llm, lookahead_llm):
    """Lookahead rows beside a plain one (max_tokens 1 leaves it no room for drafts or a window)."""
    prompts = [COPY, *OTHERS, CHAT[0]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 25, 1, 12, 30)]
    assert _tokens(lookahead_llm.generate(prompts, params)) == _tokens(embedded_llm.generate(prompts, params))


@pytest.mark.slow  # the fast tier runs the same check with the n-gram proposer (test_spec_decode.py)
def test_greedy_with_chunked_prefill_and_prefix_hits_is_identical(embedded_llm):
    check_chunked_and_prefix_hits(_lookahead_llm(max_num_batched_tokens=24), embedded_llm,
                                  [COPY, OTHERS[0], COPY, CHAT[1]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))


def test_greedy_on_a_random_model_is_identical():
    plain = LLM("dummy:tiny", cpu_kv_cache_bytes=16 << 20)
    llm = _lookahead_llm("dummy:tiny", cpu_kv_cache_bytes=16 << 20, lookahead_window=3, lookahead_ngram=4)
    prompts = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}, {"prompt_token_ids": list(range(3, 40))}]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert _tokens(llm.generate(prompts, params)) == _tokens(plain.generate(prompts, params))
    assert llm.engine.stats().spec_decode_num_draft_tokens > 0


@pytest.mark.slow  # the fast tier keeps lookahead's greedy identity
def test_seeded_sampling_is_the_same_as_without_speculation(embedded_llm, lookahead_llm):
    """At temperature > 0 the drafts are a point mass verified by acceptance.py's rule: a seed
    samples the same tokens with lookahead on or off."""
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=48, ignore_eos=True)
    messages = [{"role": "user", "content": CHAT[0]}]
    assert _tokens(lookahead_llm.chat(messages, params)) == _tokens(embedded_llm.chat(messages, params))


def test_abort_mid_speculation_leaks_no_blocks(lookahead_llm):
    engine = lookahead_llm.engine
    abort_mid_speculation(engine, [COPY, CHAT[0], OTHERS[1]], max_steps=30)
    assert not proposer_of(engine).windows  # the windows leave with their sequences


def test_pipeline_parallel_is_refused_with_the_reason():
    from goodserve.config import EngineConfig
    from goodserve.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="pipeline_parallel_size 1"):
        EngineConfig(speculative_method="lookahead", pipeline_parallel_size=2).validate()
