"""The engine end to end on the embedded model: HF agreement, batch invariance, preemption, errors."""

from dataclasses import replace

import pytest
import torch

from goodserve import LLM, SamplingParams
from goodserve.errors import EngineStepError, InvalidRequestError, ModelLoadError, PromptTooLongError
from helpers import hf_greedy, runner_of

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three colors:",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def test_greedy_matches_transformers_raw_and_chat(embedded_llm, hf_embedded):
    tok = embedded_llm.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "Name a fruit."}])
    prompts = [tok.encode(p) for p in PROMPTS[:2]] + [tok.encode(chat, add_special_tokens=False)]
    outputs = embedded_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_embedded, prompt, 32)


@pytest.mark.slow  # batched against alone; the fast tier checks a batch against transformers above
def test_batch_invariance(embedded_llm):
    """A prompt's greedy tokens do not depend on its batch, chunking or prefix-cache state."""
    tok = embedded_llm.tokenizer
    probe = tok.encode("Here is a short story about a robot who learns to paint. It lived in a small town "
                       "by the sea, and every morning it watched the fishing boats leave the harbour:")
    assert len(probe) > 32
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = embedded_llm.generate({"prompt_token_ids": probe}, params)[0].outputs[0].token_ids
    torch.manual_seed(0)
    others = [torch.randint(100, 20000, (int(n),)).tolist() for n in torch.randint(3, 90, (15,))]
    batch = [{"prompt_token_ids": probe}] + [{"prompt_token_ids": p} for p in others]
    for engine in (embedded_llm, LLM("smollm2-135m", quantization="none", enable_chunked_prefill=True, max_num_batched_tokens=32,
                                     cpu_kv_cache_bytes=128 << 20)):
        outputs = engine.generate(batch, params)
        assert outputs[0].outputs[0].token_ids == alone
        # Now probe's blocks are in the prefix cache: a hit must give the same tokens.
        hit = engine.generate({"prompt_token_ids": probe}, params)[0]
        assert hit.num_cached_tokens > 0
        assert hit.outputs[0].token_ids == alone


def test_preemption_keeps_outputs(embedded_llm):
    tok = embedded_llm.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in embedded_llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params)]
    # 6 blocks of 16 tokens: all four requests together need ~8, so some must be preempted.
    small = LLM("smollm2-135m", quantization="none", num_kv_blocks=6, block_size=16, enable_prefix_caching=False)
    outputs = small.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert small.engine.stats().num_preemptions > 0
    assert small.engine.kv.pool.num_free_blocks == 6


@pytest.mark.parametrize("policy", ["static", "dynamic"])
def test_batching_policies_give_the_same_tokens(policy):
    prompts = [{"prompt_token_ids": list(range(5 + i, 20 + 3 * i))} for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    reference = LLM("dummy:tiny", num_kv_blocks=64).generate(prompts, params)
    outputs = LLM("dummy:tiny", num_kv_blocks=64, scheduler_policy=policy, max_num_seqs=2).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]


def test_stop_strings_n_and_logprobs(embedded_llm):
    out = embedded_llm.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=40, stop=["return"]))[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == "return"
    assert "return" not in completion.text
    full = embedded_llm.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=40))[0]
    assert full.outputs[0].text.startswith(completion.text)
    out = embedded_llm.generate("Hello", SamplingParams(temperature=0.9, n=3, seed=5, max_tokens=8, logprobs=2))[0]
    assert len(out.outputs) == 3 and len({tuple(c.token_ids) for c in out.outputs}) > 1
    for completion in out.outputs:
        assert len(completion.logprobs) == len(completion.token_ids)
        for token, entry in zip(completion.token_ids, completion.logprobs):
            assert token in entry and len(entry) <= 3


def test_logprobs_match_transformers(embedded_llm, hf_embedded):
    ids = embedded_llm.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    out = embedded_llm.generate({"prompt_token_ids": ids},
                                SamplingParams(temperature=0, max_tokens=3, logprobs=1, prompt_logprobs=1))[0]
    with torch.no_grad():
        reference = torch.log_softmax(hf_embedded(torch.tensor([ids + out.outputs[0].token_ids])).logits[0], -1)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert entry[ids[pos]].logprob == pytest.approx(reference[pos - 1, ids[pos]].item(), abs=1e-3)
    for i, token in enumerate(out.outputs[0].token_ids):
        logprob = out.outputs[0].logprobs[i][token].logprob
        assert logprob == pytest.approx(reference[len(ids) - 1 + i, token].item(), abs=1e-3)


def test_prompt_logprobs_ignore_a_cached_prefix(embedded_llm):
    """Cached blocks hold K/V, not logits: a prompt-logprobs request recomputes its whole prompt."""
    ids = embedded_llm.tokenizer.encode("A prompt long enough to fill more than one block of sixteen tokens, twice over.")
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    embedded_llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1))  # caches its blocks
    cached = embedded_llm.generate({"prompt_token_ids": ids}, params)[0]
    fresh = LLM("smollm2-135m", quantization="none", enable_prefix_caching=False).generate({"prompt_token_ids": ids}, params)[0]
    assert cached.num_cached_tokens == 0
    for got, want in zip(cached.prompt_logprobs[1:], fresh.prompt_logprobs[1:]):
        assert got.keys() == want.keys()
        assert all(got[t].logprob == pytest.approx(want[t].logprob, abs=1e-4) for t in got)


def test_seeded_sampling_reproducible(embedded_llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=10)
    first = embedded_llm.generate("Tell me a joke", params)[0].outputs[0].token_ids
    batch = embedded_llm.generate(["Tell me a joke", "Another prompt"], params)
    assert batch[0].outputs[0].token_ids == first


def test_bad_input_is_typed_and_leaks_nothing(embedded_llm, tmp_path):
    engine = embedded_llm.engine
    with pytest.raises(InvalidRequestError, match="empty"):
        embedded_llm.generate({"prompt_token_ids": []})
    with pytest.raises(PromptTooLongError, match="context"):
        embedded_llm.generate({"prompt_token_ids": [5] * (engine.max_model_len + 1)})
    with pytest.raises(PromptTooLongError, match="max_tokens"):
        embedded_llm.generate("hi", SamplingParams(max_tokens=engine.max_model_len))
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)
    for bad, match in (({5: 101}, r"logit_bias\[5\]"), ({-1: 1}, "logit_bias token ids"),
                       ({i: 1 for i in range(301)}, "at most 300"), ([1], "logit_bias must map")):
        with pytest.raises(InvalidRequestError, match=match):
            SamplingParams(logit_bias=bad)
    with pytest.raises(InvalidRequestError, match="logit_bias token ids must be in"):
        embedded_llm.generate("hi", SamplingParams(logit_bias={engine.spec.vocab_size: 1.0}))
    with pytest.raises(ModelLoadError):
        LLM(str(tmp_path / "no-such-model"))
    assert not engine.has_unfinished()
    assert engine.kv.num_used_blocks == 0


def test_a_failed_step_fails_its_requests_not_the_engine(monkeypatch):
    llm = LLM("dummy:tiny", num_kv_blocks=32)
    engine = llm.engine
    real_forward = runner_of(engine).forward

    def broken_once(inputs):
        monkeypatch.setattr(runner_of(engine), "forward", real_forward)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(runner_of(engine), "forward", broken_once)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("failed", [3, 4, 5], params)
    failed = engine.step()[0]
    assert failed.error and "illegal memory access" in failed.error
    assert failed.outputs[0].finish_reason == "abort"
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished()
    monkeypatch.setattr(runner_of(engine), "forward", broken_once)
    with pytest.raises(EngineStepError, match="illegal memory access"):  # offline, as vLLM's LLM does
        llm.generate({"prompt_token_ids": [3, 4, 5]}, params)
    again = llm.generate({"prompt_token_ids": [3, 4, 5]}, params)[0]
    assert again.error is None and len(again.outputs[0].token_ids) == 4


def test_n_samples_share_the_prompt_through_the_prefix_cache():
    prompt = {"prompt_token_ids": list(range(10, 60))}  # 50 tokens: 3 full blocks of 16
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, n=3)
    single = LLM("dummy:tiny", num_kv_blocks=64).generate(prompt, SamplingParams(temperature=0, max_tokens=5,
                                                                               ignore_eos=True))[0]
    llm = LLM("dummy:tiny", num_kv_blocks=64)
    out = llm.generate(prompt, params)[0]
    assert [c.token_ids for c in out.outputs] == [single.outputs[0].token_ids] * 3
    assert llm.engine.stats().prefix_cache_hits == 2 * 48  # each later sample reused 3 blocks
    assert llm.engine.kv.num_used_blocks == 0
    aborted = LLM("dummy:tiny", num_kv_blocks=64)
    aborted.engine.add_request("r", prompt["prompt_token_ids"], params)
    assert aborted.engine.abort_request("r").outputs[2].finish_reason == "abort"
    assert not aborted.engine.has_unfinished() and aborted.engine.kv.num_used_blocks == 0


@pytest.mark.slow  # the fast tier compares a server's streamed and whole answers (test_server_openai.py)
def test_offline_text_equals_streamed_text(embedded_llm):
    """Offline generate detokenizes once at the finish; streaming detokenizes token by token. Both
    must give the text the tokenizer decodes from the output ids, for length and stop-token finishes
    (the stop token is not part of the text) and for an abort mid-request."""
    tok, engine = embedded_llm.tokenizer, embedded_llm.engine
    prompt = "Write a haiku about snow 雪 and 🌸:"  # its greedy answer has multi-token characters
    length = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    stop_id = embedded_llm.generate([prompt], length)[0].outputs[0].token_ids[14]
    for params in (length, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id])):
        offline = embedded_llm.generate([prompt], params)[0].outputs[0]
        engine.add_request("streamed", prompt, params)
        streamed = None
        while engine.has_unfinished():
            streamed = next((o for o in engine.step() if o.request_id == "streamed"), streamed)
        ids = offline.token_ids[:-1] if offline.finish_reason == "stop" else offline.token_ids
        assert streamed.outputs[0].token_ids == offline.token_ids
        assert offline.text == streamed.outputs[0].text == tok.decode(ids)
    assert offline.finish_reason == "stop"  # the second setting did hit its stop token
    engine.add_request("aborted", "Count to ten: one, two,", length)
    for _ in range(6):
        engine.step(finished_only=True)
    aborted = engine.abort_request("aborted").outputs[0]
    assert aborted.text == tok.decode(aborted.token_ids) and len(aborted.token_ids) >= 4


def test_delta_outputs_join_to_the_cumulative_ones(embedded_llm):
    """output_kind "delta" hands over only what each step added: joined step by step, the deltas are
    the cumulative outputs of the same request run beside them, with stop strings held back, logprobs
    and n > 1 (seeded, so both runs sample alike)."""
    engine, finishes = embedded_llm.engine, []
    for params in (SamplingParams(temperature=0, max_tokens=40, stop=["return"], logprobs=1),
                   SamplingParams(temperature=0.9, n=3, seed=5, max_tokens=12, logprobs=2)):
        engine.add_request("whole", "def fibonacci(n):", params)
        engine.add_request("parts", "def fibonacci(n):", replace(params, output_kind="delta"))
        joined = [["", [], []] for _ in range(params.n)]
        steps_with_text = 0
        while engine.has_unfinished():
            outputs = {o.request_id: o for o in engine.step()}
            for whole, part, total in zip(outputs["whole"].outputs, outputs["parts"].outputs, joined):
                assert len(part.logprobs) == len(part.token_ids)
                total[0] += part.text
                total[1] += part.token_ids
                total[2] += part.logprobs
                steps_with_text += bool(part.text)
                assert (total[0], total[1], total[2]) == (whole.text, whole.token_ids, whole.logprobs)
                assert part.finish_reason == whole.finish_reason
        assert steps_with_text > 2 * params.n
        finishes.append(outputs["whole"].outputs[0].finish_reason)
    assert finishes == ["stop", "length"]
    with pytest.raises(InvalidRequestError, match="output_kind"):
        SamplingParams(output_kind="final")
