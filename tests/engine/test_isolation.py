"""One bad request never hurts another: admission refuses values that overflow downstream, and a step
that fails fails only the requests that make it fail; every other request gets exactly the tokens it
gets without the culprit in the engine (synchronous and pipelined steps alike)."""

import pytest
import torch

from goodserve import LLM, SamplingParams
from goodserve.engine.worker import model_runner, worker
from goodserve.errors import InvalidRequestError
from helpers import runner_of
from test_async_scheduling import drive, engine_mode

POISON = 7  # a prompt token that breaks the forward of any step computing it (test injection)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("field, value", [
    ("top_k", 2**63), ("top_k", 10**20), ("top_k", 1e20), ("top_k", True), ("top_k", -2),
    ("top_k", 0.0), ("top_k", False), ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 1.5),
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", 1e308), ("temperature", -0.1),
    ("top_p", float("nan")), ("top_p", 0.0), ("min_p", float("inf")), ("min_p", 1.5),
    ("presence_penalty", float("nan")), ("frequency_penalty", -3), ("repetition_penalty", float("inf")),
    ("repetition_penalty", 0), ("max_tokens", 2**70), ("max_tokens", -1), ("max_tokens", 4.0),
    ("min_tokens", -1), ("logprobs", 21), ("logprobs", True), ("prompt_logprobs", -1),
    ("stop_token_ids", [-1]), ("stop_token_ids", [2**63]), ("stop_token_ids", [1.0]), ("stop", [3]),
    ("priority", 2**64), ("priority", 0.5), ("n", 0), ("n", True), ("ignore_eos", 1),
    ("logit_bias", {1: float("nan")}), ("logit_bias", {True: 1.0}), ("pooling", "max"),
])
def test_sampling_params_refuse_values_that_cannot_run(field, value):
    with pytest.raises(InvalidRequestError, match=field.removesuffix("_ids")):
        SamplingParams(**{field: value})


def test_extreme_but_valid_values_run():
    """top_k above the vocabulary keeps every token (the same draws as top_k off); the widest seeds
    and priorities are accepted and run."""
    llm = LLM("dummy:tiny", num_kv_blocks=64)
    prompt = {"prompt_token_ids": [3, 4, 5]}
    off, huge = (llm.generate(prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=6, top_k=k))[0]
                 for k in (-1, 2**31 - 1))
    assert huge.outputs[0].token_ids == off.outputs[0].token_ids
    for seed in (-(2**63), 2**63 - 1):
        out = llm.generate(prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=3, priority=-(2**63)))[0]
        assert out.error is None and len(out.outputs[0].token_ids) == 3


def test_engine_checks_stop_token_ids_and_n_against_its_config():
    llm = LLM("dummy:tiny", num_kv_blocks=64, max_n_per_request=4)
    vocab = llm.spec.vocab_size
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        llm.generate({"prompt_token_ids": [3]}, SamplingParams(stop_token_ids=[vocab]))
    with pytest.raises(InvalidRequestError, match="n must be at most 4"):
        llm.generate({"prompt_token_ids": [3]}, SamplingParams(n=5))
    assert len(llm.generate({"prompt_token_ids": [3]}, SamplingParams(n=4, max_tokens=2))[0].outputs) == 4
    assert not llm.engine.has_unfinished() and llm.engine.kv.num_used_blocks == 0


def poison_forward(monkeypatch, engine) -> None:
    real = runner_of(engine).forward

    def forward(inputs):
        if bool((inputs.input_ids == POISON).any()):
            raise RuntimeError("poisoned forward")
        return real(inputs)

    monkeypatch.setattr(runner_of(engine), "forward", forward)


def poison_sampling(monkeypatch, culprit: str, after_draws: bool) -> None:
    """Sampling raises in any batch holding the culprit: before anything is drawn, or after every
    row (seeded ones included) drew its noise."""
    real_build, real_sample = model_runner.build_sampling_batch, model_runner.sample

    def build(rows, *args):
        batch = real_build(rows, *args)
        batch.poisoned = any(row.state.seq_id.startswith(f"{culprit}#") for row in rows)
        if batch.poisoned and not after_draws:
            raise OverflowError("poisoned sampling settings")
        return batch

    def sample(logits, batch, *args):
        out = real_sample(logits, batch, *args)
        if batch.poisoned:
            raise RuntimeError("poisoned draw")
        return out

    monkeypatch.setattr(model_runner, "build_sampling_batch", build)
    monkeypatch.setattr(model_runner, "sample", sample)


def innocent_requests() -> list:
    prompts = [[3, 4, 5, 6], list(range(10, 40)), [9, 8], list(range(50, 71))]
    return [(f"r{i}", p, SEEDED if i % 2 else GREEDY) for i, p in enumerate(prompts)]


def reference_tokens(requests) -> dict:
    llm = LLM("dummy:tiny", num_kv_blocks=64)
    outputs = llm.generate([{"prompt_token_ids": p} for _, p, _ in requests], [params for *_, params in requests])
    return {request_id: out.outputs[0].token_ids for (request_id, *_), out in zip(requests, outputs)}


@pytest.mark.parametrize("injection", ["forward", "sampling settings", "after the draws"])
def test_a_failing_request_fails_alone(monkeypatch, injection):
    innocents = innocent_requests()
    expected = reference_tokens(innocents)
    llm = LLM("dummy:tiny", num_kv_blocks=64)
    engine = llm.engine
    if injection == "forward":
        poison_forward(monkeypatch, engine)
    else:
        poison_sampling(monkeypatch, "culprit", after_draws=injection == "after the draws")
    culprit = ("culprit", [POISON, 3, 4], SamplingParams(temperature=0.5, seed=2, max_tokens=8))
    # The culprit arrives with the others, and again (as culprit2 for the forward) mid-decode.
    arrivals = {0: [innocents[0], innocents[1], culprit, innocents[2]], 3: [innocents[3]]}
    if injection == "forward":
        arrivals[4] = [("culprit2", [5, POISON], GREEDY)]
    final = drive(engine, arrivals, check=True)
    for request_id in ("culprit", "culprit2")[: 2 if injection == "forward" else 1]:
        assert "poison" in final[request_id].error
        assert final[request_id].outputs[0].finish_reason == "abort"
    for request_id, tokens in expected.items():
        assert final[request_id].error is None
        assert final[request_id].outputs[0].token_ids == tokens
    assert engine.kv.num_used_blocks == 0


def test_a_request_failing_a_step_launched_ahead_fails_alone(monkeypatch, caplog):
    """Pipelined steps (decode graphs replayed eagerly on the CPU): the culprit is admitted into a step
    launched ahead, whose launch fails; that step is dropped, the next one (synchronous) isolates it."""
    innocents = [(request_id, prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
                 for request_id, prompt, _ in innocent_requests()]
    innocents[1] = ("r1", innocents[1][1], SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True))
    expected = reference_tokens(innocents)
    llm = LLM("dummy:tiny", num_kv_blocks=64, max_num_seqs=8)
    engine = llm.engine
    poison_sampling(monkeypatch, "culprit", after_draws=True)
    culprit = ("culprit", [3, 4, 5], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    with engine_mode(llm, graphs=True, async_scheduling=True) as pipelined:
        final = drive(engine, {0: innocents[:3], 3: [innocents[3]], 5: [culprit]}, check=True)
        assert pipelined() > 0
    assert "launching a step ahead failed" in caplog.text
    assert "poisoned draw" in final["culprit"].error
    for request_id, tokens in expected.items():
        assert final[request_id].error is None and final[request_id].outputs[0].token_ids == tokens
    assert engine.kv.num_used_blocks == 0


def test_prompt_logprobs_survive_preemption():
    """A preempted sequence recomputes its prompt: its prompt logprobs are those of a run without
    preemption, each entry once (the pool of 10 blocks holds about half of the batch)."""
    torch.manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (int(n),)).tolist()} for n in torch.randint(12, 40, (8,))]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True, prompt_logprobs=2)
              for i in range(len(prompts))]
    expected = LLM("dummy:tiny", num_kv_blocks=256).generate(prompts, params)
    small = LLM("dummy:tiny", num_kv_blocks=10, block_size=16, max_num_batched_tokens=64)
    got = small.generate(prompts, params)
    assert small.engine.stats().num_preemptions > 0
    for ours, ref, prompt in zip(got, expected, prompts):
        assert ours.error is None and ours.outputs[0].token_ids == ref.outputs[0].token_ids
        assert len(ours.prompt_logprobs) == len(prompt["prompt_token_ids"]) and ours.prompt_logprobs[0] is None
        for mine, theirs in zip(ours.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            assert mine.keys() == theirs.keys()
            assert [e.logprob for e in mine.values()] == pytest.approx([e.logprob for e in theirs.values()], abs=1e-5)
    assert small.engine.kv.num_used_blocks == 0


def test_triton_on_the_cpu_is_refused_at_construction(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(InvalidRequestError, match="needs a CUDA device.*TRITON_INTERPRET=1"):
        LLM("dummy:tiny", num_kv_blocks=16, attention_backend="triton", device="cpu")


def test_the_activation_reserve_is_sized_for_the_budget_the_engine_runs_with(monkeypatch):
    """Without chunked prefill a whole prompt is one step: the budget grows to the context before the KV
    pool is sized around the activations of such a step. The caller's config is left as it was."""
    from goodserve.config import EngineConfig
    from goodserve.engine.frontend.engine import Engine

    seen = []
    real = worker.num_blocks_for_memory

    def sizing(spec, config, *args):
        seen.append(config.max_num_batched_tokens)
        return real(spec, config, *args)

    monkeypatch.setattr(worker, "num_blocks_for_memory", sizing)
    config = EngineConfig(model="dummy:tiny", num_kv_blocks=64, enable_chunked_prefill=False,
                          max_num_batched_tokens=16, max_model_len=200)
    engine = Engine(config, max_num_seqs=4)
    assert seen == [engine.config.max_num_batched_tokens] and engine.config.max_num_batched_tokens >= 200
    assert config.max_num_batched_tokens == 16 and config.max_num_seqs is None


# The fast tier has its parts: prompt logprobs surviving preemption (above, dummy:tiny), preemption on the
# embedded model and its prompt logprobs against transformers (test_engine.py).
@pytest.mark.slow
def test_prompt_logprobs_under_preemption_match_transformers(hf_embedded):
    """On the embedded model: prompt logprobs of preempted (recomputed) requests
    against log_softmax of Hugging Face's forward over the same prompt."""
    small = LLM("smollm2-135m", quantization="none", num_kv_blocks=6, block_size=16, enable_prefix_caching=False)
    prompts = [small.tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):",
                                                   "Once upon a time, in a land far away,", "List three colors:")]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1)
    outputs = small.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert small.engine.stats().num_preemptions > 0
    for ids, out in zip(prompts, outputs):
        with torch.no_grad():
            reference = torch.log_softmax(hf_embedded(torch.tensor([ids])).logits[0], -1)
        assert len(out.prompt_logprobs) == len(ids)
        for pos in range(1, len(ids)):
            assert out.prompt_logprobs[pos][ids[pos]].logprob == pytest.approx(reference[pos - 1, ids[pos]].item(),
                                                                                abs=1e-3)
