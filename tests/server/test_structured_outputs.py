"""Structured outputs and tool calling through `goodserve serve` on loopback, with the official openai
client and the embedded model. References: `jsonschema` for schemas, `re` for regexes, the request's
own choices and tool parameter schemas. One server for the module."""

from __future__ import annotations

import asyncio
import json
import random
import re

import httpx2
import jsonschema
import openai
import pytest

from helpers import HTTP_TIMEOUT_S, InProcessServer


MODEL = "smollm2-135m"
WORDS = ["name", "size", "color", "price", "city", "count", "label", "score", "owner", "kind"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server():
    server = InProcessServer(["--max-model-len", "1024", "--max-num-seqs", "64", "--slo-ttft-ms", "600000"])
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Objects of integers, numbers, enums, booleans, short strings, arrays and (nested) objects."""
    properties = {}
    for i in range(rng.randint(1, 4 if depth == 0 else 2)):
        kind = rng.choice(["integer", "number", "enum", "boolean", "string", "array"] + ["object"] * (depth < 2))
        if kind == "integer":
            spec = {"type": "integer", "minimum": -50, "maximum": 5000}
        elif kind == "enum":
            spec = {"enum": rng.sample(["red", "green", "blue", "small", "large", "yes", "no"], 3)}
        elif kind == "string":
            spec = {"type": "string", "maxLength": rng.randint(3, 16)}
        elif kind == "array":
            spec = {"type": "array", "items": rng.choice([{"type": "integer"}, {"enum": ["a", "b", "c"]}]),
                    "minItems": 1, "maxItems": 3}
        elif kind == "object":
            spec = random_schema(rng, depth + 1)
        else:
            spec = {"type": kind}
        properties[f"{rng.choice(WORDS)}_{i}"] = spec
    required = rng.sample(sorted(properties), rng.randint(1, len(properties)))
    return {"type": "object", "properties": properties, "required": required}


# Fifty seeded random schemas, in two runs of requests at once: the first eight in the fast tier,
# the other forty-two in the full one.
@pytest.mark.parametrize("first, end", [(0, 8), pytest.param(8, 50, marks=pytest.mark.slow)],
                         ids=["first-8", "last-42"])
def test_fifty_seeded_json_schema_requests_parse_and_validate(server, first, end):
    rng = random.Random(18)
    schemas = [random_schema(rng) for _ in range(50)][first:end]

    async def one(client, i: int, schema: dict) -> tuple[dict, object]:
        response = await client.chat.completions.create(
            model=MODEL, seed=i, temperature=0.7, max_tokens=200,
            messages=[{"role": "user", "content": f"Give an example JSON object for this schema: {json.dumps(schema)}"}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        return schema, response.choices[0]

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, i, s) for i, s in enumerate(schemas, start=first)))

    for schema, choice in asyncio.run(all_at_once()):
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_regex_and_choice_hold(client):
    out = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=100, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe a cat as a JSON object with keys name and age."}])
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    pattern = r"[A-Z][a-z]{2,8}, [0-9]{1,3} (km|mi)"
    out = client.completions.create(model=MODEL, prompt="The nearest city and its distance:", max_tokens=30,
                                    temperature=0.9, seed=3, n=3, extra_body={"guided_regex": pattern})
    assert all(re.fullmatch(pattern, c.text) for c in out.choices), [c.text for c in out.choices]
    choices = ["Paris", "Berlin", "Rome"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        out = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=10, extra_body=extra,
                                             messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert out.choices[0].message.content in choices
    out = client.completions.create(model=MODEL, prompt="Answer yes or no: is the sky blue?", max_tokens=5,
                                    temperature=0, extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
    assert out.choices[0].text in ("yes", "no")


def test_streamed_json_schema_with_logprobs(client):
    schema = {"type": "object", "properties": {"animal": {"enum": ["cat", "dog"]}, "legs": {"type": "integer"}},
              "required": ["animal", "legs"]}
    stream = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=40, stream=True, logprobs=True, top_logprobs=3,
        messages=[{"role": "user", "content": "Name a pet and its number of legs."}],
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # The constrained distribution: right after `{"` the grammar forces `animal`, so it is certain.
    assert all(e.logprob <= 0 and all(t.logprob >= -9999 for t in e.top_logprobs) for e in entries)


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "invalid JSON schema"),
    ({"extra_body": {"guided_regex": "(ab"}}, "invalid regex"),
    ({"extra_body": {"guided_grammar": "root ::= undefined_rule"}}, "invalid grammar"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}}, "one grammar"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
])
def test_bad_grammars_are_400_naming_the_problem(client, body, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=5, **body)


def arguments_of(call, tool: dict) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_named_tool_call_validates_streamed_and_not(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME],
                                         tool_choice=named, temperature=0, max_tokens=60)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    expected = arguments_of(call, WEATHER)
    stream = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME],
                                            tool_choice=named, temperature=0, max_tokens=60, stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [tc for d in deltas for tc in d.delta.tool_calls or []]
    assert calls[0].id and calls[0].function.name == "get_weather" and len(calls) > 1  # arguments in chunks
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == expected
    assert deltas[-1].finish_reason == "tool_calls"


def test_required_tool_calls_validate_against_their_tool(client):
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for stream in (False, True):
        for parallel in (True, False):
            kwargs = dict(model=MODEL, messages=ASK_WEATHER, tools=list(tools.values()), tool_choice="required",
                          parallel_tool_calls=parallel, temperature=0, max_tokens=120)
            if stream:
                chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
                calls = [tc for c in chunks for tc in c.delta.tool_calls or []]
                finish = chunks[-1].finish_reason
            else:
                choice = client.chat.completions.create(**kwargs).choices[0]
                calls, finish = choice.message.tool_calls, choice.finish_reason
            assert finish == "tool_calls" and calls and (parallel or len(calls) == 1)
            for call in calls:
                arguments_of(call, tools[call.function.name])


def test_tool_results_flow_back_through_the_template(server, client):
    """SmolLM2's template knows no tools: the Hermes fallback renders the tools, the assistant's call
    and the tool's result into the prompt, and the request answers."""
    messages = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'}]
    tokens = httpx2.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=HTTP_TIMEOUT_S).json()["tokens"]
    prompt = httpx2.post(f"{server.url}/detokenize", json={"tokens": tokens}, timeout=HTTP_TIMEOUT_S).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in prompt
    assert '<tool_response>\n{"temperature": 21, "sky": "sunny"}\n</tool_response>' in prompt
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                         max_tokens=30)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert out.usage.prompt_tokens > len(tokens)  # the tools' system block too
