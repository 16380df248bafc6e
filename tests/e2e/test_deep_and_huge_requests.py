"""One request must never stall the service: schemas nested deep or grammars grown huge are refused at
admission with a 400 naming the bound, a grammar is compiled once (by the server; the engine's
process loads it), and a huge enum beside a running stream never holds that stream up.

The app in-process (httpx's ASGI transport) over the embedded model's engine in its own process, as
`goodserve serve` runs it: the grammar crosses that boundary."""

from __future__ import annotations

import asyncio
import json

import httpx2
import pytest

from goodserve.config import EngineConfig
from goodserve.engine.frontend.engine_process import EngineProcess
from goodserve.engine.frontend.grammar import GrammarCompiler
from goodserve.model.tokenizer_loader import embedded_tokenizer
from goodserve.sampling_params import SamplingParams
from goodserve.server.app import ServerConfig, build_app
from goodserve.structured_outputs import MAX_GRAMMAR_BYTES, MAX_SCHEMA_DEPTH, StructuredOutputsParams

PROMPT = [{"role": "user", "content": "Pick one."}]


def nested_schema(levels: int) -> dict:
    """An object schema `levels` objects deep: 2 JSON levels each ({"properties": {"a": ...}})."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def enum_schema(values: int) -> dict:
    return {"type": "object", "properties": {"v": {"enum": [f"value-{i:06d}" for i in range(values)]}},
            "required": ["v"]}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine = EngineProcess(EngineConfig(model="smollm2-135m", max_model_len=512, device="cpu"))
    app = build_app(engine, ServerConfig(data_dir=str(tmp_path_factory.mktemp("data"))))
    loop = asyncio.new_event_loop()
    lifespan = app.router.lifespan_context(app)
    loop.run_until_complete(lifespan.__aenter__())
    try:
        yield loop, app, engine
    finally:
        loop.run_until_complete(lifespan.__aexit__(None, None, None))
        loop.close()


async def post(app, path: str, body: dict | str) -> httpx2.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://goodserve",
                                  timeout=600) as client:
        return await client.post(path, content=content, headers={"content-type": "application/json"})


def chat(**fields) -> dict:
    return {"messages": [dict(m) for m in PROMPT], "max_tokens": 4, **fields}


def named_tool(parameters: dict) -> dict:
    tool = {"type": "function", "function": {"name": "pick", "parameters": parameters}}
    return chat(tools=[tool], tool_choice={"type": "function", "function": {"name": "pick"}})


@pytest.mark.parametrize("make_body, field", [
    (lambda s: chat(guided_json=s), "guided_json"),
    (lambda s: chat(guided_json=json.dumps(s)), "guided_json"),
    (lambda s: chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": s}}),
     "response_format"),
    (lambda s: chat(structured_outputs={"json": s}), "structured_outputs"),
    (named_tool, "tools[0].function.parameters"),
])
def test_a_schema_nested_past_the_bound_is_a_400_naming_field_and_bound(served, make_body, field):
    loop, app, _ = served
    just_past = loop.run_until_complete(post(app, "/v1/chat/completions",
                                             make_body(nested_schema(MAX_SCHEMA_DEPTH // 2 + 1))))
    assert just_past.status_code == 400, just_past.text
    assert just_past.json()["error"]["message"].startswith(f"{field}: the JSON schema is nested more than "
                                                           f"{MAX_SCHEMA_DEPTH} levels deep")
    # the 250 objects (~14 KB): past the body's own bound where the schema is JSON, not text
    deep = loop.run_until_complete(post(app, "/v1/chat/completions", make_body(nested_schema(250))))
    assert deep.status_code == 400, deep.text
    assert "nested more than" in deep.json()["error"]["message"]


def test_a_schema_within_the_bound_is_served_by_the_engine_process(served):
    loop, app, _ = served
    reply = loop.run_until_complete(post(app, "/v1/chat/completions",
                                         chat(guided_json=nested_schema(3), max_tokens=40)))
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"].startswith('{"a": {"a": {"a": "')


def test_a_body_nested_past_its_bound_is_a_400(served):
    loop, app, _ = served
    body = chat()
    body["messages"][0]["content"] = [{"type": "text", "text": "x", "meta": json.loads("[" * 900 + "]" * 900)}]
    for raw in (json.dumps(body), '{"messages": ' + "[" * 5000 + "]" * 5000 + "}"):
        reply = loop.run_until_complete(post(app, "/v1/chat/completions", raw))
        assert reply.status_code == 400, reply.text


def test_grammars_past_the_size_bound_are_a_400_naming_it(served):
    loop, app, _ = served
    big_regex = "(" + "|".join(f"w{i:07d}" for i in range(MAX_GRAMMAR_BYTES // 9 + 1)) + ")"
    for body in (chat(guided_regex=big_regex), chat(guided_choice=[f"c{i:07d}" for i in range(MAX_GRAMMAR_BYTES // 10)]),
                 chat(guided_json=enum_schema(10_000))):
        reply = loop.run_until_complete(post(app, "/v1/chat/completions", body))
        assert reply.status_code == 400, reply.text
        assert str(MAX_GRAMMAR_BYTES) in reply.json()["error"]["message"]


def test_a_huge_enum_beside_a_running_stream_is_refused_while_the_stream_runs(served):
    """The issue's 100,000-value enum: refused before any compile, so the stream beside it has not
    finished when the refusal comes; an enum at the bound is compiled once and served."""
    loop, app, engine = served
    events: list[str] = []

    async def innocent() -> int:
        params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0.0)
        tokens = 0
        async for out in engine.generate("innocent", [1, 2, 3, 4, 5], params):
            tokens = len(out.outputs[0].token_ids)
            events.append(f"token {tokens}")
        events.append("innocent done")
        return tokens

    async def huge() -> httpx2.Response:
        while not events:  # the stream is running
            await asyncio.sleep(0.01)
        reply = await post(app, "/v1/chat/completions", chat(guided_json=enum_schema(100_000)))
        events.append(f"huge {reply.status_code}")
        return reply

    async def both():
        return await asyncio.gather(innocent(), huge())

    tokens, reply = loop.run_until_complete(both())
    assert tokens == 128 and reply.status_code == 400
    assert events.index("huge 400") < events.index("innocent done"), events
    at_bound = enum_schema(7_000)
    assert len(json.dumps(at_bound)) < MAX_GRAMMAR_BYTES
    reply = loop.run_until_complete(post(app, "/v1/chat/completions", chat(guided_json=at_bound, max_tokens=40)))
    assert reply.status_code == 200, reply.text
    assert json.loads(reply.json()["choices"][0]["message"]["content"])["v"] in at_bound["properties"]["v"]["enum"]


def test_a_grammar_compiled_in_one_process_is_loaded_in_another_without_compiling(monkeypatch):
    tokenizer = embedded_tokenizer()
    spec = StructuredOutputsParams(choice=("yes", "no"))
    here = GrammarCompiler(tokenizer, 49152)
    text = here.serialized(spec)
    there = GrammarCompiler(tokenizer, 49152)
    monkeypatch.setattr(there, "_compile", lambda spec: pytest.fail("compiled again"))
    there.adopt(spec, text)
    state = there.new_state(there.compile(spec))
    for token in tokenizer.encode("yes", add_special_tokens=False):
        state.accept(token)
    state.accept(tokenizer.eos_token_ids[0])
    assert state.matcher.is_terminated()
