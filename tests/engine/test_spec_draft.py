"""Speculative decoding with a draft model (engine/spec_decode/draft_model.py): the target's own
weights quantized (self:int4) on the embedded model, another model (dummy presets); the exact
rejection rule for sampled drafts (rejection.py); the draft's own KV cache kept in step.

Greedy outputs are token-for-token those of speculation off (embedded_llm is the reference), alone,
in mixed batches, with chunked prefill and prefix-cache hits; no block leaks, target or draft, after
aborts mid-speculation; a chi-square test shows the rejection rule keeps the target distribution
(and that it catches a rule that does not)."""

from __future__ import annotations

import pytest
import torch

from goodserve import LLM, SamplingParams
from goodserve.cli import main
from goodserve.engine.worker import worker
from goodserve.engine.spec_decode.rejection import kept_by_rejection
from goodserve.errors import InvalidRequestError
from goodserve.ops.kernel_choice import KernelChoice
from goodserve.ops.sampler import SamplingBatch, sample
from helpers import drafter_of, proposer_of, runner_of

PROMPTS = ["Once upon a time", "What are three tips for staying healthy?", "def fibonacci(n):\n",
           "The capital of France is"]
LONG = ("Summarize in one sentence: The quick brown fox jumps over the lazy dog. A journey of a thousand miles "
        "begins with a single step. To be or not to be, that is the question.")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


# The self-int4 drafter's engine takes ~11 s to build: its tests are the full tier's (the fast tier keeps
# a draft model's greedy identity, test_another_draft_model_greedy_is_identical).
needs_self_drafter = pytest.mark.slow


@pytest.fixture(scope="module")
def self_draft_llm():
    """self:int4, with a token budget small enough to chunk the prompts and cut drafts short."""
    return LLM("smollm2-135m", quantization="none", cpu_kv_cache_bytes=64 << 20, speculative_model="self:int4",
               num_speculative_tokens=3, max_num_batched_tokens=24)


def _tokens(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def _draft_blocks(llm: LLM) -> int:
    return proposer_of(llm).kv.num_used_blocks


def _draft_blocks_once_told(llm: LLM) -> int:
    """The draft's blocks in use once the drafter has heard of the finishes so far: the news goes to
    the runner with the next step (here one that drafts nothing: its only token is its last)."""
    llm.generate(["Hi"], SamplingParams(max_tokens=1))
    return _draft_blocks(llm)


def _accepted(llm: LLM) -> int:
    return llm.engine.stats().spec_decode_num_accepted_tokens


# ---- exactness in the engine ---------------------------------------------------------------------
@needs_self_drafter
def test_self_int4_greedy_alone_is_identical(embedded_llm, self_draft_llm):
    before = _accepted(self_draft_llm)
    assert _tokens(self_draft_llm.generate(PROMPTS[:1], GREEDY)) == _tokens(embedded_llm.generate(PROMPTS[:1], GREEDY))
    assert _accepted(self_draft_llm) > before
    assert self_draft_llm.engine.kv.num_used_blocks == 0 and _draft_blocks_once_told(self_draft_llm) == 0


@needs_self_drafter
def test_self_int4_greedy_mixed_batch_chunked_prefill_and_prefix_hits(embedded_llm, self_draft_llm):
    """Different lengths in one batch, prompts chunked by the 24-token budget; the second round hits
    the prefix cache (the draft prefills its own cache all the same)."""
    prompts = [*PROMPTS, LONG]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 6, 10, 8, 10)]
    expected = _tokens(embedded_llm.generate(prompts, params))
    assert _tokens(self_draft_llm.generate(prompts, params)) == expected
    hits = self_draft_llm.engine.stats().prefix_cache_hits
    assert _tokens(self_draft_llm.generate(prompts, params)) == expected
    assert self_draft_llm.engine.stats().prefix_cache_hits > hits
    assert self_draft_llm.engine.kv.num_used_blocks == 0 and _draft_blocks_once_told(self_draft_llm) == 0


def test_another_draft_model_greedy_is_identical():
    """A different model with the same vocabulary (dummy:tiny-llama3 drafting for dummy:tiny): few
    drafts survive, the output is the target's all the same."""
    options = dict(cpu_kv_cache_bytes=8 << 20, max_num_batched_tokens=16)
    prompts = [{"prompt_token_ids": ids} for ids in ([*range(5, 22)], [40, 41, 42], [5, 6, 7, 8])]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = _tokens(LLM("dummy:tiny", **options).generate(prompts, params))
    llm = LLM("dummy:tiny", speculative_model="dummy:tiny-llama3", num_speculative_tokens=4, **options)
    assert _tokens(llm.generate(prompts, params)) == expected
    assert llm.engine.stats().spec_decode_num_draft_tokens > 0
    same = LLM("dummy:tiny", speculative_model="dummy:tiny", num_speculative_tokens=4, **options)
    assert _tokens(same.generate(prompts, params)) == expected
    stats = same.engine.stats()  # the target's own weights as the draft: every draft is kept
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0


def test_the_kv_budget_holds_the_draft_pool_beside_the_targets():
    """The draft's pool has as many blocks as the target's: the budget (cpu_kv_cache_bytes; on CUDA
    the memory both models' weights leave) must hold both pools, not the target's alone."""
    budget = 8 << 20
    llm = LLM("dummy:tiny", speculative_model="dummy:tiny-llama3", cpu_kv_cache_bytes=budget)
    caches = runner_of(llm).kv_caches + proposer_of(llm).kv_caches
    held = sum(cache.k.nbytes + cache.v.nbytes for cache in caches)
    per_block = held // llm.engine.kv.num_blocks  # the target's block and the draft's
    assert budget - per_block < held <= budget


def test_the_draft_weights_are_loaded_before_the_pool_is_sized(monkeypatch):
    """On CUDA the pool is sized from the device's free memory: the draft's weights must hold theirs
    by then, or the draft would not fit beside the pool."""
    events = []
    load_draft, sizing = worker.load_draft, worker.num_blocks_for_memory
    monkeypatch.setattr(worker, "load_draft", lambda *args: events.append("draft") or load_draft(*args))
    monkeypatch.setattr(worker, "num_blocks_for_memory", lambda *args: events.append("pool") or sizing(*args))
    LLM("dummy:tiny", speculative_model="dummy:tiny", cpu_kv_cache_bytes=8 << 20)
    assert events == ["draft", "pool"]


@needs_self_drafter
def test_abort_mid_speculation_frees_target_and_draft_blocks(self_draft_llm):
    engine = self_draft_llm.engine
    accepted = _accepted(self_draft_llm)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"abort-{i}", prompt, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(30):
        engine.step()
        if _accepted(self_draft_llm) > accepted and engine.stats().num_running == 3:
            break
    assert _accepted(self_draft_llm) > accepted and _draft_blocks(self_draft_llm) > 0
    for i in range(3):
        engine.abort_request(f"abort-{i}")
    assert not engine.has_unfinished() and engine.kv.num_used_blocks == 0
    assert _draft_blocks_once_told(self_draft_llm) == 0


@needs_self_drafter
def test_the_drafter_keeps_each_running_sequences_tokens_as_the_scheduler_has_them(self_draft_llm):
    """The drafter in the runner proposes from its own copy of each sequence's tokens (its prompt,
    then what each step kept): mid-run, sampled and greedy, it is the scheduler's."""
    engine = self_draft_llm.engine
    for i, temperature in enumerate((0.0, 0.9)):
        engine.add_request(f"copy-{i}", PROMPTS[i], SamplingParams(temperature=temperature, seed=i, max_tokens=40,
                                                                   ignore_eos=True))
    accepted, checked = _accepted(self_draft_llm), 0
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            assert drafter_of(self_draft_llm).seqs[seq.seq_id].token_ids == seq.token_ids
            checked += 1
    assert checked > 20 and _accepted(self_draft_llm) > accepted


def test_a_failing_request_fails_alone_beside_drafting_ones(monkeypatch):
    """A step that fails is cut into trial steps, which keep nothing (the rejection rule's draws on a
    seeded row's generator included), then run again without its culprit: the others, drafting
    greedy and seeded-sampled rows, get the tokens they get without the culprit in the engine."""
    from test_async_scheduling import drive
    from test_isolation import POISON, innocent_requests, poison_forward

    options = dict(num_kv_blocks=64, speculative_model="dummy:tiny", num_speculative_tokens=3, spec_policy="always")
    innocents = innocent_requests()
    reference = drive(LLM("dummy:tiny", **options).engine, {0: innocents[:3], 3: innocents[3:]})
    llm = LLM("dummy:tiny", **options)
    poison_forward(monkeypatch, llm.engine)
    # the culprit arrives mid-decode: its prompt's step holds the others' drafts
    final = drive(llm.engine, {0: innocents[:3], 3: innocents[3:], 4: [("culprit", [5, POISON], GREEDY)]})
    assert "poison" in final["culprit"].error
    assert llm.engine.stats().spec_decode_num_draft_tokens > 0
    for request_id, output in reference.items():
        assert final[request_id].error is None
        assert final[request_id].outputs[0].token_ids == output.outputs[0].token_ids, request_id


@needs_self_drafter
def test_sampled_drafts_run_reproducibly_with_logprobs(self_draft_llm):
    """Temperature > 0 verifies with the rejection rule: a seed gives the same tokens twice, every
    kept token has its logprob, and drafts are kept."""
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=24, ignore_eos=True, logprobs=1)
    before = _accepted(self_draft_llm)
    first, second = (self_draft_llm.generate(PROMPTS[:2], params) for _ in range(2))
    assert _tokens(first) == _tokens(second)
    for out in first:
        sample_ = out.outputs[0]
        assert len(sample_.logprobs) == len(sample_.token_ids) == 24
        assert all(token in entry for entry, token in zip(sample_.logprobs, sample_.token_ids))
    assert _accepted(self_draft_llm) > before


# ---- the rejection rule --------------------------------------------------------------------------
def _rejection_chi_square(accept_all: bool) -> list[float]:
    """Drafts d_0, d_1 sampled from non-trivial q_0, q_1, verified against p_0..p_2 (the target's
    sampler distributions at temperature 1) over many seeded draws; the chi-square statistics of the
    first kept token against p_0 and of the second (where d_0 was kept) against p_1. accept_all: a
    wrong rule (every draft kept, as if q were 0), which must fail."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    vocab, draws = 6, 8_000
    logits = torch.tensor([[1.0, 0.2, 0.5, -1.0, 0.0, 0.7], [0.3, -0.5, 1.2, 0.0, 0.9, -2.0], [0.0] * vocab])
    q = torch.tensor([[0.1, 0.3, 0.2, 0.2, 0.1, 0.1], [0.4, 0.1, 0.1, 0.1, 0.2, 0.1]])
    rows = 3 * draws
    batch = SamplingBatch(temperature=torch.ones(rows), top_k=torch.full((rows,), vocab), top_p=torch.ones(rows),
                          min_p=torch.zeros(rows), generators=[None] * rows, needs_top_k_p=False)
    sampled = sample(logits.repeat(draws, 1), batch, KernelChoice())
    drafts = torch.multinomial(q.repeat(draws, 1), 1, generator=generator).view(draws, 2).tolist()
    bonus = sampled.token_ids.view(draws, 3)[:, 2].tolist()
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for i in range(draws):
        kept = kept_by_rejection(sampled.probs[3 * i : 3 * i + 3], torch.zeros_like(q) if accept_all else q,
                                 drafts[i], bonus[i], generator)
        first[kept[0]] += 1
        if kept[0] == drafts[i][0] and len(kept) > 1:
            second[kept[1]] += 1
    p = logits.softmax(-1)
    return [float(((counts - counts.sum() * p[j]) ** 2 / (counts.sum() * p[j])).sum())
            for j, counts in enumerate((first, second))]


def test_rejection_sampling_keeps_the_target_distribution():
    chi_square_5_dof_p001 = 20.52
    assert all(stat < chi_square_5_dof_p001 for stat in _rejection_chi_square(accept_all=False))
    assert all(stat > 10 * chi_square_5_dof_p001 for stat in _rejection_chi_square(accept_all=True))


# ---- configuration errors ------------------------------------------------------------------------
@pytest.mark.parametrize("options, message", [
    (dict(speculative_model="smollm2-135m"), "must share the target's tokenizer"),
    (dict(speculative_model="self:int3"), "self:int4"),
    (dict(speculative_model="self:int4", speculative_method="ngram"), "cannot be combined"),
    (dict(speculative_method="draft"), "needs --speculative-model"),
])
def test_bad_draft_options_are_refused_clearly(options, message):
    with pytest.raises(InvalidRequestError, match=message):
        LLM("dummy:tiny", cpu_kv_cache_bytes=8 << 20, **options)


@pytest.mark.slow  # loads the embedded model to refuse it; the fast tier has the same refusal through LLM
def test_cli_refuses_a_draft_with_another_vocabulary(capsys):
    assert main(["generate", "--model", "dummy:tiny", "--prompt", "hi", "--max-tokens", "2",
                 "--cpu-kv-cache-bytes", str(8 << 20), "--speculative-model", "smollm2-135m"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("goodserve: error:") and "share the target's tokenizer" in err and "Traceback" not in err
