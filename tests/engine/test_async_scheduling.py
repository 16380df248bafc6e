"""Async scheduling (decode step N+1 launched before step N's tokens reach the host) on the CPU.

It engages only where decode graphs replay, so the runner gets eager stand-ins for its CUDA graphs
(as in test_model_runner.py): the pipelined code path runs as on a GPU, with synchronous copies.
Each run is compared with the synchronous engine: same tokens, same finish reasons, no block leaked.
"""

import contextlib
import dataclasses
import random

import pytest
import torch

from goodserve import SamplingParams
from goodserve.engine.worker import cuda_graphs
from goodserve.engine.seam.runner_output import PendingOutput
from goodserve.engine.spec_decode.policy import PROBE_EVERY
from helpers import runner_of, set_proposer


class EagerDecodeGraph(cuda_graphs._DecodeGraph):
    def _capture(self, pool) -> None:
        pass

    def replay(self, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._forward()
        return self.logits[:num_seqs], self.logits_argmax[:num_seqs]


@contextlib.contextmanager
def engine_mode(llm, graphs: bool, async_scheduling: bool):
    engine = llm.engine
    runner = runner_of(engine)
    saved = runner.graphs.decode, engine.config
    if graphs:
        sizes = (1, 2, 4, 8)
        runner.graphs.decode = cuda_graphs.GraphSet({size: EagerDecodeGraph(runner, size, None) for size in sizes},
                                                    dict.fromkeys(sizes, 1.0))
    # The CPU resolves async scheduling off (no graphs there): these stand-in graphs turn it back on.
    engine.config = dataclasses.replace(engine.config, async_scheduling=async_scheduling)
    start = engine.steps.num_pipelined_steps
    try:
        yield lambda: engine.steps.num_pipelined_steps - start
    finally:
        runner.graphs.decode, engine.config = saved
        assert engine._inflight is None and not engine.has_unfinished()


def check_blocks(engine) -> None:
    """Every block's ref count is exactly the number of live block tables holding it."""
    pool, scheduler = engine.kv.pool, engine.scheduler
    refs = [0] * pool.num_blocks
    for seq in list(scheduler.running) + list(scheduler.waiting):
        for block_id in engine.kv.block_table(seq.seq_id):
            refs[block_id] += 1
    for block in pool.blocks:
        assert block.ref_count == refs[block.block_id]
        assert (block.ref_count == 0) == (block.block_id in pool.free)


def abort_mid_pipeline(engine, requests) -> dict:
    """Run the requests with a1 aborted at step 4 and a3 at step 9, each while a step is in flight,
    checking the block accounting after every event; the aborted requests' outputs."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    aborted = {}
    for step in range(40):
        if not engine.has_unfinished():
            break
        if engine._inflight is not None and step in (4, 9):  # the abort lands mid-pipeline
            rid = "a1" if step == 4 else "a3"
            aborted[rid] = engine.abort_request(rid)
            check_blocks(engine)
        engine.step(finished_only=True)
        check_blocks(engine)
    assert not engine.has_unfinished() and engine.kv.num_used_blocks == 0
    assert set(aborted) == {"a1", "a3"}
    return aborted


def drive(engine, arrivals: dict[int, list], aborts: dict[int, list[str]] | None = None,
          check: bool = False) -> dict:
    """Step until done; arrivals[k] / aborts[k] happen before step call k. Returns the final
    outputs by request id, checking that streamed outputs only ever grow."""
    aborts = aborts or {}
    last = max([*arrivals, *aborts, 0])
    final, seen, step = {}, {}, 0
    while engine.has_unfinished() or step <= last:
        for request_id, prompt, params in arrivals.get(step, []):
            engine.add_request(request_id, prompt, params)
        for request_id in aborts.get(step, []):
            output = engine.abort_request(request_id)
            if output is not None:
                final[request_id] = output
        for output in engine.step():
            tokens = output.outputs[0].token_ids
            previous = seen.get(output.request_id, [])
            assert tokens[: len(previous)] == previous and len(tokens) >= len(previous)
            seen[output.request_id] = list(tokens)
            if output.finished:
                final[output.request_id] = output
        if check:
            check_blocks(engine)
        step += 1
    assert engine.kv.num_used_blocks == 0, "blocks leaked"
    return final


def summary(outputs: dict) -> dict:
    return {rid: [(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in out.outputs]
            for rid, out in outputs.items()}


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,",
           "A long time ago, in a galaxy far, far away, there lived a small droid who dreamed of stars.",
           "The quick brown fox"]


@pytest.fixture(scope="module")
def stop_token(embedded_llm):
    """A token that greedy decoding of the first prompt produces a few tokens in."""
    tok = embedded_llm.tokenizer
    out = embedded_llm.generate([{"prompt_token_ids": tok.encode(PROMPTS[0])}],
                                SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return out[0].outputs[0].token_ids[6]


def mixed_traffic(tok, stop_token: int, **extra) -> dict[int, list]:
    """Mixed prompt lengths and max_tokens (the batch shrinks), a stop token some requests hit, and
    arrivals while others decode (they end a pipeline, which must restart)."""
    arrivals: dict[int, list] = {}
    for i, (prompt, max_tokens, at) in enumerate(zip(PROMPTS, (14, 5, 22, 9, 17, 11), (0, 0, 0, 3, 8, 15))):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=False,
                                stop_token_ids=[stop_token], **extra)
        arrivals.setdefault(at, []).append((f"r{i}", tok.encode(prompt), params))
    return arrivals


def test_greedy_tokens_match_the_synchronous_engine(embedded_llm, stop_token):
    engine, tok = embedded_llm.engine, embedded_llm.tokenizer
    with engine_mode(embedded_llm, graphs=False, async_scheduling=True) as pipelined:
        reference = summary(drive(engine, mixed_traffic(tok, stop_token)))
        assert pipelined() == 0  # no graphs: never engages
    assert any(c[0][1] == "stop" for c in reference.values()), "the stop token must end some request"
    assert any(c[0][1] == "length" for c in reference.values())
    with engine_mode(embedded_llm, graphs=True, async_scheduling=False) as pipelined:
        assert summary(drive(engine, mixed_traffic(tok, stop_token), check=True)) == reference
        assert pipelined() == 0  # the flag turns it off
    steps_before = engine.steps.num_steps
    with engine_mode(embedded_llm, graphs=True, async_scheduling=True) as pipelined:
        assert summary(drive(engine, mixed_traffic(tok, stop_token), check=True)) == reference
        # most decode steps ran ahead (the rest: prefills, the first step after each flush)
        assert pipelined() >= (engine.steps.num_steps - steps_before) // 2


def test_seeded_sampling_matches_the_synchronous_engine(embedded_llm, stop_token):
    engine, tok = embedded_llm.engine, embedded_llm.tokenizer
    def traffic():
        # n=2: one sample may stop while its sibling runs on (its spare token must be dropped)
        return {0: [(f"s{i}", tok.encode(p), SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=16,
                                                           n=2 if i == 0 else 1, stop_token_ids=[stop_token]))
                    for i, p in enumerate(PROMPTS[:3])]}
    with engine_mode(embedded_llm, graphs=True, async_scheduling=False):
        reference = summary(drive(engine, traffic()))
    with engine_mode(embedded_llm, graphs=True, async_scheduling=True) as pipelined:
        assert summary(drive(engine, traffic())) == reference
        assert pipelined() > 0


@pytest.mark.parametrize("extra", [{"logprobs": 2}, *(pytest.param(extra, marks=pytest.mark.slow)  # one is enough fast
                                                      for extra in ({"repetition_penalty": 1.3}, {"stop": ["the"]},
                                                                    {"min_tokens": 4}))])
def test_host_dependent_sampling_falls_back_to_synchronous(embedded_llm, stop_token, extra):
    engine, tok = embedded_llm.engine, embedded_llm.tokenizer
    traffic = mixed_traffic(tok, stop_token, **extra)
    with engine_mode(embedded_llm, graphs=False, async_scheduling=True):
        reference = drive(engine, traffic)
    with engine_mode(embedded_llm, graphs=True, async_scheduling=True) as pipelined:
        got = drive(engine, traffic)
        if "min_tokens" in extra:  # pipelines once every sequence in the batch has min_tokens
            assert pipelined() > 0
        else:
            assert pipelined() == 0
    assert summary(got) == summary(reference)
    if "logprobs" in extra:
        assert {r: o.outputs[0].logprobs for r, o in got.items()} == \
               {r: o.outputs[0].logprobs for r, o in reference.items()}


def test_one_host_dependent_request_pauses_the_pipeline_only_while_it_runs(embedded_llm, stop_token):
    engine, tok = embedded_llm.engine, embedded_llm.tokenizer
    traffic = mixed_traffic(tok, stop_token)
    rid, prompt, params = traffic[0][1]  # the shortest request wants logprobs
    traffic[0][1] = (rid, prompt, SamplingParams(temperature=0, max_tokens=params.max_tokens, logprobs=1,
                                                 stop_token_ids=[stop_token]))
    with engine_mode(embedded_llm, graphs=False, async_scheduling=True):
        reference = summary(drive(engine, traffic))
    with engine_mode(embedded_llm, graphs=True, async_scheduling=True) as pipelined:
        assert summary(drive(engine, traffic)) == reference
        assert pipelined() > 0


def test_aborts_while_a_step_is_in_flight_leak_nothing(embedded_llm):
    engine, tok = embedded_llm.engine, embedded_llm.tokenizer
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    arrivals = {0: [(f"a{i}", tok.encode(p), params) for i, p in enumerate(PROMPTS[:4])]}
    with engine_mode(embedded_llm, graphs=True, async_scheduling=True):
        reference = summary(drive(engine, arrivals))
    with engine_mode(embedded_llm, graphs=True, async_scheduling=True) as pipelined:
        aborted = abort_mid_pipeline(engine, arrivals[0])
        assert pipelined() > 0
    for rid, output in aborted.items():
        choice = output.outputs[0]
        assert choice.finish_reason == "abort"
        full = reference[rid][0][0]
        assert 0 < len(choice.token_ids) < len(full) and choice.token_ids == full[: len(choice.token_ids)]


def test_random_traffic_with_stops_and_aborts_keeps_blocks_exact(embedded_llm, stop_token):
    """Seeded random arrivals, stop tokens and aborts (often while a step is in flight) against the
    synchronous engine on the same schedule of events."""
    engine, tok = embedded_llm.engine, embedded_llm.tokenizer
    rng = random.Random(7)
    arrivals, aborts = {}, {}
    for i in range(10):
        prompt = tok.encode(rng.choice(PROMPTS))[: rng.randrange(2, 20)]
        params = SamplingParams(temperature=0, max_tokens=rng.randrange(2, 24),
                                stop_token_ids=[stop_token] if rng.random() < 0.5 else [])
        arrivals.setdefault(rng.randrange(0, 40), []).append((f"q{i}", prompt, params))
        if rng.random() < 0.3:
            aborts.setdefault(rng.randrange(1, 50), []).append(f"q{i}")
    with engine_mode(embedded_llm, graphs=False, async_scheduling=True):
        reference = summary(drive(engine, arrivals, aborts, check=True))
    with engine_mode(embedded_llm, graphs=True, async_scheduling=True) as pipelined:
        got = summary(drive(engine, arrivals, aborts, check=True))
        assert pipelined() > 0
    # An abort lands one step later in the pipelined run's token count only if it differs; the
    # requests never aborted must match exactly.
    aborted = {rid for rids in aborts.values() for rid in rids}
    assert {r: v for r, v in got.items() if r not in aborted} == \
           {r: v for r, v in reference.items() if r not in aborted}


def test_prefill_only_and_biased_requests_arriving_mid_pipeline(embedded_llm, stop_token):
    """Embedding requests never sample, so they are never launched ahead (they finish on the host);
    a logit_bias applies in pipelined steps as in synchronous ones."""
    engine, tok = embedded_llm.engine, embedded_llm.tokenizer
    traffic = mixed_traffic(tok, stop_token)
    traffic[0][1] = (*traffic[0][1][:2], SamplingParams(temperature=0, max_tokens=9, logit_bias={stop_token: 8.0}))
    for step in (4, 9):
        traffic.setdefault(step, []).append((f"e{step}", tok.encode(PROMPTS[step % 6]),
                                             SamplingParams(max_tokens=0, pooling="mean")))
    with engine_mode(embedded_llm, graphs=False, async_scheduling=True):
        reference = drive(engine, traffic)
    with engine_mode(embedded_llm, graphs=True, async_scheduling=True) as pipelined:
        got = drive(engine, traffic, check=True)
        assert pipelined() > 0
    assert summary(got) == summary(reference)
    for rid in ("e4", "e9"):
        torch.testing.assert_close(torch.tensor(got[rid].embedding), torch.tensor(reference[rid].embedding))


def test_a_step_whose_tokens_never_arrive_fails_its_requests_not_the_engine(embedded_llm, monkeypatch):
    """A pipelined step that fails after its launch (its tokens never reach the host) fails the
    requests of the steps in flight; their blocks come back and the engine goes on."""
    engine, tok = embedded_llm.engine, embedded_llm.tokenizer
    runner = runner_of(engine)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with engine_mode(embedded_llm, graphs=True, async_scheduling=True) as pipelined:
        real = runner.sample_tokens

        def failing(*args):
            pending = real(*args)
            if pipelined() < 3:
                return pending

            def lost():
                raise RuntimeError("the device lost the step")
            return PendingOutput(lost, pending.replayed_graph)

        monkeypatch.setattr(runner, "sample_tokens", failing)
        final = drive(engine, {0: [(f"x{i}", tok.encode(p), params) for i, p in enumerate(PROMPTS[:2])]},
                      check=True)
        monkeypatch.undo()
    assert all("the device lost the step" in out.error for out in final.values())
    again = embedded_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3))[0]
    assert again.error is None and len(again.outputs[0].token_ids) == 3


# Greedy decoding of a story long enough for probes (one step in PROBE_EVERY): speculation's tests.
STORY = "Once upon a time"
STORY_PARAMS = SamplingParams(temperature=0, max_tokens=3 * PROBE_EVERY, ignore_eos=True)


@pytest.fixture(scope="module")
def story_tokens(embedded_llm) -> list[int]:
    """The plain synchronous engine's greedy tokens for STORY: the reference of both tests below."""
    return embedded_llm.generate([STORY], STORY_PARAMS)[0].outputs[0].token_ids


@pytest.mark.slow  # a speculating engine; the fast tier keeps async scheduling's greedy and seeded identity
def test_speculation_still_drafts_under_async_scheduling(story_tokens):
    """A step scheduled ahead of the one in flight cannot carry drafts (they continue tokens not yet
    on the host), so while the speculator may draft the engine does not run ahead: drafts are made
    and verified, and the tokens are plain greedy decoding's."""
    from test_spec_decode import _spec_llm, _tokens

    # No earlier occurrence of its last token: the first decode steps have no drafts (the sequence
    # leaves the plan after a few misses, and steps run ahead); the story repeats itself later,
    # where a probe (one step in PROBE_EVERY) finds prompt lookup's matches again.
    spec_llm = _spec_llm()
    with engine_mode(spec_llm, graphs=True, async_scheduling=True):
        tokens = _tokens(spec_llm.generate([STORY], STORY_PARAMS))
    stats = spec_llm.engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0 and stats.num_pipelined_steps > 0
    assert tokens == [story_tokens]


class _WrongProposer:
    """Proposes a token greedy decoding never picks here: every verification rejects its drafts."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, wanted):
        from goodserve.engine.seam.drafts import Drafts

        return [Drafts([self.token] * r.k) for r in wanted]

    def release(self, seq_id) -> None:
        pass


@pytest.mark.slow  # a speculating engine; the fast tier keeps async scheduling's greedy and seeded identity
def test_rejected_speculation_stops_and_steps_run_ahead_again(story_tokens):
    """Once a sequence's drafts keep being rejected the policy plans none for it, so the engine runs
    ahead of the step in flight again, but for the probes' bounded share of steps."""
    from test_spec_decode import _spec_llm, _tokens

    spec_llm = _spec_llm()
    set_proposer(spec_llm, _WrongProposer(spec_llm.tokenizer.encode("zebra")[0]))
    with engine_mode(spec_llm, graphs=True, async_scheduling=True) as pipelined:
        tokens = _tokens(spec_llm.generate([STORY], STORY_PARAMS))
        assert pipelined() > 2 * PROBE_EVERY
    stats = spec_llm.engine.stats()
    # a few tries while its acceptance estimate falls from the unmeasured 0.5, then a probe per PROBE_EVERY steps
    assert 0 < stats.spec_decode_num_drafts <= 8 + 3 and stats.spec_decode_num_accepted_tokens == 0
    assert tokens == [story_tokens]
