"""Grammars in the engine (offline LLM, embedded model): free requests keep their exact greedy tokens
beside constrained ones; n > 1, logprobs, stop strings, prefix caching and preemption keep outputs
valid; a request whose grammar fails fails alone. References: `re`, `json`, and the same requests
run alone or on an engine that never preempts."""

import json
import re

import pytest

from goodserve import LLM, SamplingParams, StructuredOutputsParams
from goodserve.engine.frontend.grammar import grammar_bitmask
from goodserve.errors import InvalidRequestError
from test_async_scheduling import engine_mode

FREE = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "List three colors:"]
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


def constrained(**grammar) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(**grammar))


def test_free_requests_keep_their_greedy_tokens_in_a_mixed_batch(embedded_llm):
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in embedded_llm.generate(FREE, free)]
    prompts = [p for pair in zip(FREE, ["A person:", "Today's date:", "A pet:", "Born on"]) for p in pair]
    params = [p for pair in zip([free] * 4, [constrained(json=PERSON), constrained(regex=DATE)] * 2) for p in pair]
    outputs = embedded_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs[0::2]] == alone
    person = json.loads(outputs[1].outputs[0].text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert re.fullmatch(DATE, outputs[3].outputs[0].text)


def test_no_mask_is_built_for_a_batch_without_grammars(embedded_llm):
    engine = embedded_llm.engine
    engine.add_request("plain", "Hello", SamplingParams(temperature=0))
    seq = engine.requests["plain"].seqs[0]
    assert grammar_bitmask([seq], pinned=False) is None
    engine.abort_request("plain")


def test_n_samples_logprobs_and_stop_strings_follow_the_grammar(embedded_llm):
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=20, logprobs=5, stop=["-1"],
                            structured_outputs=StructuredOutputsParams(regex=DATE))
    (out,) = embedded_llm.generate(["Some dates in history:"], params)
    for c in out.outputs:
        if c.finish_reason == "stop" and c.stop_reason == "-1":  # cut by the stop string: a valid prefix
            assert re.fullmatch(r"(19|20)[0-9]{2}", c.text), c.text
        else:
            assert re.fullmatch(DATE, c.text) and c.finish_reason == "stop", c.text
        # Logprobs of the constrained distribution: the first token's alternatives are all "1" or "2".
        first = c.logprobs[0]
        tokenizer = embedded_llm.tokenizer
        assert all(tokenizer.decode([t]) in ("1", "2") or lp.logprob == -9999.0 for t, lp in first.items())


@pytest.mark.slow  # the fast tier keeps grammars in mixed batches and under async scheduling
def test_preemption_and_prefix_cache_keep_grammar_outputs(embedded_llm):
    intro = "Here is a list of people with their names and ages, each written as one JSON object per line. "
    prompts = [intro + p for p in ("A person:", "Another person:", "A third person:", "One more, please:")]
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=PERSON))
    expected = [o.outputs[0].text for o in embedded_llm.generate(prompts, params)]
    again = embedded_llm.generate(prompts, params)  # the prompts' blocks now come from the prefix cache
    assert [o.outputs[0].text for o in again] == expected and again[0].num_cached_tokens > 0
    small = LLM("smollm2-135m", quantization="none", num_kv_blocks=9, block_size=16, enable_prefix_caching=False)
    outputs = small.generate(prompts, params)
    assert small.engine.stats().num_preemptions > 0
    assert [o.outputs[0].text for o in outputs] == expected
    for text in expected:
        assert set(json.loads(text)) == {"name", "age"}


def test_a_failing_grammar_fails_its_request_alone(embedded_llm):
    engine = embedded_llm.engine
    engine.add_request("good", "A person:", constrained(json=PERSON))
    engine.add_request("free", "Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.add_request("bad-mask", "A date:", constrained(regex=DATE))
    engine.add_request("bad-token", "A date:", constrained(regex=DATE))

    class BrokenMatcher:  # not xgrammar's: filling any batch that holds it raises
        def is_terminated(self) -> bool:
            return False

    engine.requests["bad-mask"].seqs[0].grammar.matcher = BrokenMatcher()
    engine.requests["bad-token"].seqs[0].grammar.matcher.accept_token = lambda token: False
    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step(finished_only=True))
    assert outputs["bad-mask"].error
    assert "not allowed by the request's grammar" in outputs["bad-token"].error
    assert outputs["good"].error is None and json.loads(outputs["good"].outputs[0].text)
    assert outputs["free"].error is None and len(outputs["free"].outputs[0].token_ids) == 8
    assert engine.kv.num_used_blocks == 0 or engine.config.enable_prefix_caching


def test_grammars_compile_once_and_bad_ones_are_typed_errors(embedded_llm):
    grammars = embedded_llm.engine.inputs.grammars
    spec = StructuredOutputsParams(json=PERSON)
    assert grammars.compile(spec) is grammars.compile(StructuredOutputsParams(json=dict(PERSON)))
    with pytest.raises(InvalidRequestError, match="invalid regex"):
        embedded_llm.generate(["x"], constrained(regex="[a-"))
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])


def test_grammar_requests_run_ahead_with_async_scheduling(embedded_llm):
    """A pipelined step's masks take the previous step's tokens once its forward is launched: the
    outputs equal the synchronous engine's, spare rows after a grammar's end included."""
    prompts = ["A person:", "Today's date:", "Hello", "Born on", "A pet:"]
    params = [constrained(json=PERSON), constrained(regex=DATE), SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=30,
                             structured_outputs=StructuredOutputsParams(regex=DATE)),
              constrained(choice=["cat", "dog", "a small hamster"])]
    texts = {}
    for graphs, async_scheduling in ((False, False), (True, True)):
        with engine_mode(embedded_llm, graphs=graphs, async_scheduling=async_scheduling) as pipelined:
            outputs = embedded_llm.generate(prompts, params)
            texts[graphs] = [[c.text for c in o.outputs] for o in outputs]
            assert (pipelined() > 0) == graphs
    assert texts[True] == texts[False]
    assert re.fullmatch(DATE, texts[True][1][0]) and all(re.fullmatch(DATE, t) for t in texts[True][3])


def test_a_grammar_ends_before_min_tokens(embedded_llm):
    params = SamplingParams(temperature=0, max_tokens=30, min_tokens=20,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    (out,) = embedded_llm.generate(["Is the sky blue?"], params)
    assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"
