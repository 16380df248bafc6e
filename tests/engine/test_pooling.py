"""Prefill-only requests (max_tokens=0) on the embedded model: embeddings against transformers' own
final hidden states, pooled and normalized by hand, through chunked prefill, the prefix cache and a
batch shared with generation; prompt scoring without a generated token."""

import pytest
import torch

from goodserve import LLM, SamplingParams

STORY = ("Here is a short story about a robot who learns to paint. It lived in a small town by the sea, and "
         "every morning it watched the fishing boats leave the harbour before it set up its easel on the pier.")


@pytest.fixture(scope="module")
def chunked_llm():
    # A 16-token step budget: the story's prompt is prefilled over several chunks, beside other requests.
    return LLM("smollm2-135m", quantization="none", enable_chunked_prefill=True, max_num_batched_tokens=16,
               cpu_kv_cache_bytes=64 << 20)


@torch.no_grad()
def hf_embedding(hf_model, ids: list[int], pooling: str) -> torch.Tensor:
    hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0]  # after the final norm
    pooled = hidden.mean(dim=0) if pooling == "mean" else hidden[-1]
    return pooled / pooled.norm()


def test_embeddings_equal_transformers_hidden_states_through_chunks_cache_and_batching(chunked_llm, hf_embedded):
    tok = chunked_llm.tokenizer
    story, short = tok.encode(STORY), tok.encode("Hello world")
    assert len(story) > 2 * 16
    mean, last = SamplingParams(max_tokens=0, pooling="mean"), SamplingParams(max_tokens=0, pooling="last")
    generate = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [story, short, story, story, short]
    params = [mean, mean, last, generate, last]
    outs = chunked_llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, p, out in zip(prompts, params, outs):
        if p.pooling is None:
            assert out.embedding is None and len(out.outputs[0].token_ids) == 6
            continue
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
        torch.testing.assert_close(torch.tensor(out.embedding), hf_embedding(hf_embedded, prompt, p.pooling),
                                   atol=2e-4, rtol=1e-3)
    again = chunked_llm.generate({"prompt_token_ids": story}, [mean])[0]  # the story's blocks are cached now
    torch.testing.assert_close(torch.tensor(again.embedding), torch.tensor(outs[0].embedding), atol=1e-5, rtol=0)
    assert chunked_llm.engine.kv.num_used_blocks == 0


def test_max_tokens_0_scores_the_prompt_as_a_generating_request_does(chunked_llm):
    story = chunked_llm.tokenizer.encode(STORY)
    scored, generated = chunked_llm.generate([{"prompt_token_ids": story}] * 2, [
        SamplingParams(max_tokens=0, prompt_logprobs=2), SamplingParams(max_tokens=1, prompt_logprobs=2)])
    assert scored.outputs[0].token_ids == [] and scored.outputs[0].text == ""
    assert len(scored.prompt_logprobs) == len(story) and scored.prompt_logprobs[0] is None
    for got, expected in zip(scored.prompt_logprobs[1:], generated.prompt_logprobs[1:]):
        assert got.keys() == expected.keys()  # the same tokens; values within chunking's float noise
        assert all(abs(got[t].logprob - expected[t].logprob) < 1e-4 for t in got)


def test_pooling_needs_a_prefill_only_request():
    from goodserve.errors import InvalidRequestError

    for bad in (dict(pooling="max", max_tokens=0), dict(pooling="mean"), dict(pooling="last", max_tokens=0, n=2)):
        with pytest.raises(InvalidRequestError, match="pooling"):
            SamplingParams(**bad)
