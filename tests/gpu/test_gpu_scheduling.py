"""Chunked prefill and prefix-cache hits on CUDA, the embedded model in float32 against transformers."""

from __future__ import annotations

import pytest
import torch
from gate_checks import assert_within, build, compare, engine_scores, greedy, hf_scores, run, tolerance

from goodserve import SamplingParams
from goodserve.model.tokenizer_loader import embedded_tokenizer
from goodserve.model_names import EMBEDDED_MODEL
from goodserve.quant.awq import default_calibration_text

CHUNK_TOKENS = 64


@pytest.fixture(scope="module")
def text_ids() -> list[int]:
    return embedded_tokenizer().encode(default_calibration_text())


def test_chunked_prefill_matches_transformers(text_ids, device, cuda_only, hf_embedded_on_device, record_property):
    prompt = text_ids[:200]
    assert len(prompt) > CHUNK_TOKENS  # four steps of prefill
    llm = build(EMBEDDED_MODEL, device, dtype="float32", max_num_batched_tokens=CHUNK_TOKENS)
    steps_before = llm.engine.stats().num_steps
    tokens = greedy(llm, [prompt])[0]
    record_property("steps", llm.engine.stats().num_steps - steps_before)
    # The prompt logprobs come through the same chunks.
    sequence = prompt + tokens
    comparison = compare([sequence], [len(prompt)], engine_scores(llm, [sequence]),
                         hf_scores(hf_embedded_on_device, [sequence]))
    for prop in comparison.properties():
        record_property(*prop)
    assert_within(comparison, tolerance("float32", "auto"))


def test_prefix_hits_give_the_same_tokens(text_ids, device, cuda_only, hf_embedded_on_device, record_property):
    llm = build(EMBEDDED_MODEL, device, dtype="float32")
    greedy_params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = text_ids[:100]
    first = run(llm, [prompt], greedy_params)[0]
    hits_before = llm.engine.stats().prefix_cache_hits
    second = run(llm, [prompt], greedy_params)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 96  # six full blocks of 16
    assert llm.engine.stats().prefix_cache_hits > hits_before
    assert second.outputs[0].token_ids == first.outputs[0].token_ids

    # A shared prefix with another ending: the cached blocks serve it, and its tokens are transformers'.
    other = text_ids[:80] + text_ids[300:320]
    third = run(llm, [other], greedy_params)[0]
    record_property("cached_tokens", [second.num_cached_tokens, third.num_cached_tokens])
    assert third.num_cached_tokens >= 64
    sequence = other + third.outputs[0].token_ids
    comparison = compare([sequence], [len(other)], engine_scores(llm, [sequence]),
                         hf_scores(hf_embedded_on_device, [sequence]))
    for prop in comparison.properties():
        record_property(*prop)
    assert_within(comparison, tolerance("float32", "auto"))


@torch.no_grad()
def test_embeddings_and_logit_bias_on_cuda_match_transformers(text_ids, device, cuda_only, hf_embedded_on_device):
    """Pooling rows read from a mixed graph's hidden states, across prefill chunks, beside a
    generating request whose logit_bias applies in graph-replayed (and pipelined) steps."""
    llm = build(EMBEDDED_MODEL, device, dtype="float32", max_num_batched_tokens=CHUNK_TOKENS)
    hf = hf_embedded_on_device
    long, short, generating = text_ids[:150], text_ids[200:230], text_ids[300:320]
    first = int(hf(torch.tensor([generating], device=device)).logits[0, -1].argmax())
    banned = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={first: -100.0})
    outs = run(llm, [long, short, generating], [SamplingParams(max_tokens=0, pooling="mean"),
                                                SamplingParams(max_tokens=0, pooling="last"), banned])
    for ids, out, pooling in ((long, outs[0], "mean"), (short, outs[1], "last")):
        hidden = hf.model(torch.tensor([ids], device=device)).last_hidden_state[0]
        pooled = hidden.mean(dim=0) if pooling == "mean" else hidden[-1]
        torch.testing.assert_close(torch.tensor(out.embedding, device=device), pooled / pooled.norm(),
                                   atol=1e-3, rtol=1e-3)
    tokens = outs[2].outputs[0].token_ids
    logits = hf(torch.tensor([generating], device=device)).logits[0, -1]
    logits[first] -= 100.0
    assert first not in tokens and tokens[0] == int(logits.argmax())


def test_graphed_prompt_lookup_gives_the_speculation_off_tokens(text_ids, device, cuda_only, record_property):
    """Greedy ngram speculation with CUDA graphs on, float32, on a copy-like prompt (a passage, then
    its start again): the same tokens as speculation off, and the verify steps replay mixed-step
    graphs (none runs eagerly)."""
    passage = text_ids[:120]
    prompt = passage + passage[:12]
    off = greedy(build(EMBEDDED_MODEL, device, dtype="float32"), [prompt], max_tokens=64)[0]
    llm = build(EMBEDDED_MODEL, device, dtype="float32", speculative_method="ngram", num_speculative_tokens=4)
    assert greedy(llm, [prompt], max_tokens=64)[0] == off
    stats = llm.engine.stats()
    record_property("verify_steps", stats.num_verify_steps)
    record_property("graphed_verify_steps", stats.num_graphed_verify_steps)
    assert stats.spec_decode_num_accepted_tokens > 0
    assert 0 < stats.num_graphed_verify_steps == stats.num_verify_steps


@pytest.mark.parametrize("executor_backend", ["uni", "mp"])
def test_a_draft_model_in_the_worker_gives_the_speculation_off_tokens(text_ids, device, cuda_only, record_property,
                                                                      executor_backend):
    """A draft model (the embedded model's self:int8 weights) run by the runner's drafter after each
    step, in the engine's process or a worker process, with CUDA graphs on: the greedy tokens of
    speculation off, drafts kept, and a seeded sampled run (the rejection rule, with the
    distributions the drafter kept) repeats itself."""
    prompt = text_ids[:100]
    off = greedy(build(EMBEDDED_MODEL, device, dtype="float32"), [prompt], max_tokens=48)[0]
    llm = build(EMBEDDED_MODEL, device, dtype="float32", speculative_model="self:int8", num_speculative_tokens=4,
                spec_policy="always", executor_backend=executor_backend)
    assert greedy(llm, [prompt], max_tokens=48)[0] == off
    stats = llm.engine.stats()
    record_property("drafts_kept", [stats.spec_decode_num_accepted_tokens, stats.spec_decode_num_draft_tokens])
    assert stats.spec_decode_num_accepted_tokens > 0
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=32, ignore_eos=True)
    first, second = ([out.outputs[0].token_ids for out in run(llm, [prompt], sampled)] for _ in range(2))
    assert first == second
