"""tool_choice required with parallel calls: the array ends where the model repeats a call.

After a complete call the grammar allows only `,` or `]`, and after `]` only the end of generation
(checked on xgrammar's token mask over the embedded tokenizer). A small model greedy under that
grammar still writes the same call again and again until max_tokens; the server ends the array at
the first call identical to an earlier one. The reference is the same prompt under the same array
schema as a plain response_format (tool_choice auto: the tools in the prompt alike, the text left
alone), its complete calls read by the standard library's JSON decoder, and jsonschema for each
returned call's arguments. The app in-process with the official openai client."""

from __future__ import annotations

import asyncio
import json

import pytest

import httpx2
import jsonschema
import openai
import xgrammar

from goodserve.config import EngineConfig
from goodserve.engine.frontend.async_engine import AsyncEngine
from goodserve.engine.frontend.grammar import GrammarCompiler
from goodserve.model.tokenizer_loader import embedded_tokenizer
from goodserve.server.app import ServerConfig, build_app
from goodserve.server.protocol import ChatCompletionRequest
from goodserve.server.tool_calls import output_calls, tool_grammar

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"]}}}
TOOLS = {"get_weather": WEATHER, "get_time": TIME}
# Asked what no tool answers, the model (greedy) repeats one call until max_tokens.
ASK = [{"role": "user", "content": "Tell me a joke."}]
MAX_TOKENS = 150
CALLS_SCHEMA = {"type": "array", "minItems": 1, "items": {"anyOf": [
    {"type": "object", "properties": {"name": {"const": name}, "arguments": tool["function"]["parameters"]},
     "required": ["name", "arguments"]} for name, tool in TOOLS.items()]}}
PARIS, LONDON = ({"name": "get_weather", "arguments": {"city": city, "unit": "celsius"}}
                 for city in ("Paris", "London"))


def request(tool_choice="required") -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=ASK, tools=list(TOOLS.values()), tool_choice=tool_choice)


def test_after_a_complete_call_the_grammar_allows_a_comma_or_the_end_then_only_eos():
    tokenizer = embedded_tokenizer()
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    matcher = compiler.new_state(compiler.compile(tool_grammar(request()))).matcher

    def allowed() -> set[str]:
        mask = xgrammar.allocate_token_bitmask(1, compiler.vocab_size)
        matcher.fill_next_token_bitmask(mask)
        ids = [i for i in range(compiler.vocab_size) if mask[0, i // 32] >> (i % 32) & 1]
        return {"<eos>" if i in tokenizer.eos_token_ids else tokenizer.decode([i]) for i in ids}

    for token in tokenizer.encode(json.dumps([PARIS])[:-1]):  # one complete call, the array open
        assert matcher.accept_token(token)
    assert allowed() == {",", "]"}
    assert matcher.accept_token(tokenizer.encode("]")[0])
    assert allowed() == {"<eos>"}


def test_a_repeated_call_ends_the_array_and_is_dropped():
    def calls(text: str, truncated=False):
        content, found = output_calls(request(), "required", text, truncated)
        return content, [(c.name, json.loads(c.arguments)) for c in found]

    pairs = [("get_weather", PARIS["arguments"]), ("get_weather", LONDON["arguments"])]
    ended_early = json.dumps([PARIS, LONDON, PARIS])[:-1]  # stopped as the repeat completed
    assert calls(ended_early) == (None, pairs)
    assert calls(ended_early + ", {") == (None, pairs)  # a step's tokens past the repeat
    assert calls(json.dumps([PARIS, LONDON, PARIS, LONDON])) == (None, pairs)  # closed by the model
    reordered = {"name": "get_weather", "arguments": {"unit": "celsius", "city": "Paris"}}
    assert calls(json.dumps([PARIS, reordered])) == (None, pairs[:1])  # the same arguments in another order
    # Not a repeat, not cut, not an array: the text stays the content (the grammar makes it impossible).
    assert calls(json.dumps([PARIS, LONDON])[:-1]) == (json.dumps([PARIS, LONDON])[:-1], [])


async def _ask(data_dir) -> tuple:
    """The reference text, then the required calls: not streamed, streamed, and n=2."""
    engine = AsyncEngine(EngineConfig(model=MODEL, max_model_len=1024))
    app = build_app(engine, ServerConfig(data_dir=str(data_dir)))
    async with app.router.lifespan_context(app):
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://app",
                                      timeout=600) as http:
            client = openai.AsyncOpenAI(base_url="http://app/v1", api_key="none", http_client=http, max_retries=0)
            common = dict(model=MODEL, messages=ASK, tools=list(TOOLS.values()), temperature=0, max_tokens=MAX_TOKENS)
            reference = await client.chat.completions.create(tool_choice="auto", response_format={
                "type": "json_schema", "json_schema": {"name": "calls", "schema": CALLS_SCHEMA}}, **common)
            forced = await client.chat.completions.create(tool_choice="required", **common)
            stream = await client.chat.completions.create(tool_choice="required", stream=True, **common)
            chunks = [chunk.choices[0] async for chunk in stream if chunk.choices]
            twice = await client.chat.completions.create(tool_choice="required", n=2, **common)
    return reference, forced, chunks, twice


def complete_calls(text: str) -> list:
    """The calls of an array cut anywhere, each read where the one before it ended."""
    decoder, calls, at = json.JSONDecoder(), [], text.find("{")
    while at >= 0:
        try:
            call, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            break
        calls.append(call)
        at = text.find("{", end)
    return calls


@pytest.mark.slow  # a server and long generations; the fast tier checks the grammar's ending above
def test_greedy_required_calls_end_at_the_first_repeat_streamed_and_not(tmp_path):
    reference, forced, chunks, twice = asyncio.run(_ask(tmp_path))
    assert reference.choices[0].finish_reason == "length"  # left alone, the model repeats until max_tokens
    everything = complete_calls(reference.choices[0].message.content)
    first_repeat = next(i for i, call in enumerate(everything) if call in everything[:i])
    expected = [(c["name"], c["arguments"]) for c in everything[:first_repeat]]

    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert forced.usage.completion_tokens < MAX_TOKENS  # the request stopped at the repeat
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == expected
    for name, arguments in calls:
        jsonschema.validate(arguments, TOOLS[name]["function"]["parameters"])

    streamed = [tc for c in chunks for tc in c.delta.tool_calls or []]
    assert chunks[-1].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed] == expected
    for choice in twice.choices:  # n=2, both greedy: each ends at its repeat, then the request stops
        assert choice.finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == expected
    assert twice.usage.completion_tokens < 2 * MAX_TOKENS
