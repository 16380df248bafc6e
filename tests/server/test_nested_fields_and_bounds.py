"""Request bounds checked in the app in-process (httpx's ASGI transport) over the embedded model: a
field a nested object (a message, a tool, a format) does not declare is refused by name like a
top-level one (or dropped under --allow-unknown-fields); a batch's metadata within OpenAI's bounds;
/tokenize and /detokenize bounded by the context and run off the event loop."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx2
import pytest

from goodserve.config import EngineConfig
from goodserve.engine.frontend.async_engine import AsyncEngine
from goodserve.server.app import ServerConfig, build_app

MAX_MODEL_LEN = 256
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def engine():
    """Started once, shared by the tests' apps (an app's lifespan would stop it at its end)."""
    engine = AsyncEngine(EngineConfig(model="smollm2-135m", max_model_len=MAX_MODEL_LEN, device="cpu"))
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.shutdown(5.0))


def call(engine, tmp_path, requests: list[tuple[str, str, dict]], **config) -> list[httpx2.Response]:
    app = build_app(engine, ServerConfig(data_dir=str(tmp_path), **config))

    async def run():
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://goodserve",
                                      timeout=300) as client:
            return [await client.request(method, path, content=json.dumps(body),
                                         headers={"content-type": "application/json"})
                    for method, path, body in requests]

    return asyncio.run(run())


NESTED_UNKNOWN = [
    ({**CHAT, "messages": [{"role": "user", "content": "Hi", "frobnicate": 1}]}, "messages[0].frobnicate"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "x": "y"}]}]},
     "messages[0].content[0].x"),
    ({**CHAT, "tools": [{**TOOL, "function": {**TOOL["function"], "bogus": True}}]}, "tools[0].function.bogus"),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {}, "extra": 1}}},
     "response_format.json_schema.extra"),
]


def test_an_unknown_field_inside_an_object_is_a_400_naming_its_path(engine, tmp_path):
    replies = call(engine, tmp_path, [("POST", "/v1/chat/completions", body) for body, _ in NESTED_UNKNOWN])
    for reply, (_, path) in zip(replies, NESTED_UNKNOWN):
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["message"].startswith(f"unknown field '{path}'")
        assert reply.json()["error"]["param"] == path


def test_allow_unknown_fields_drops_nested_ones_too(engine, tmp_path, caplog):
    replies = call(engine, tmp_path, [("POST", "/v1/chat/completions", body) for body, _ in NESTED_UNKNOWN],
                   allow_unknown_fields=True)
    assert [r.status_code for r in replies] == [200] * len(NESTED_UNKNOWN)
    assert "messages[0].frobnicate" in caplog.text


def test_echoed_output_fields_are_not_unknown(engine, tmp_path):
    """An earlier response's message sent back as the openai client dumps it."""
    assistant = {"role": "assistant", "content": "Hello", "refusal": None, "annotations": [], "audio": None}
    body = {**CHAT, "messages": [*CHAT["messages"], assistant, {"role": "user", "content": "Again"}]}
    assert call(engine, tmp_path, [("POST", "/v1/chat/completions", body)])[0].status_code == 200


def test_batch_metadata_past_openais_bounds_is_a_400(engine, tmp_path):
    batch = {"input_file_id": "file-none", "endpoint": "/v1/completions", "completion_window": "24h"}
    bad = [{"k" * 65: "v"}, {"k": "v" * 513}, {f"k{i}": "v" for i in range(17)}]
    replies = call(engine, tmp_path, [("POST", "/v1/batches", {**batch, "metadata": m}) for m in bad])
    assert [r.status_code for r in replies] == [400] * 3
    for reply, words in zip(replies, ["64 characters", "512 characters", "16 items"]):
        assert words in reply.json()["error"]["message"]
    ok = call(engine, tmp_path, [("POST", "/v1/batches", {**batch, "metadata": {"k" * 64: "v" * 512}})])[0]
    assert ok.status_code == 404  # past the bounds check: its file does not exist


def test_detokenize_is_bounded_by_the_context_and_runs_off_the_event_loop(engine, tmp_path, monkeypatch):
    threads = []
    decode = engine.tokenizer.decode
    monkeypatch.setattr(engine.tokenizer, "decode", lambda ids: threads.append(threading.current_thread()) or
                        decode(ids))
    ids = engine.tokenizer.encode("Hello there, general Kenobi.", add_special_tokens=False)
    ok, too_many = call(engine, tmp_path, [("POST", "/detokenize", {"tokens": ids}),
                                           ("POST", "/detokenize", {"tokens": [1] * (MAX_MODEL_LEN + 1)})])
    assert ok.status_code == 200 and ok.json()["prompt"] == "Hello there, general Kenobi."
    assert threads and all(t is not threading.main_thread() for t in threads)
    assert too_many.status_code == 400 and str(MAX_MODEL_LEN) in too_many.json()["error"]["message"]


def test_tokenize_answers_at_most_the_context(engine, tmp_path):
    """A short text of many tokens (under the bytes that surely exceed the context, so it is
    tokenized) gets a 400 naming the context, not a list of ids longer than any sequence can be."""
    many = " x" * (MAX_MODEL_LEN + 10)
    assert len(engine.tokenizer.encode(many, add_special_tokens=False)) > MAX_MODEL_LEN
    ok, prompt, messages = call(engine, tmp_path, [
        ("POST", "/tokenize", {"prompt": " x" * 10}), ("POST", "/tokenize", {"prompt": many}),
        ("POST", "/tokenize", {"messages": [{"role": "user", "content": many}]})])
    assert ok.status_code == 200 and ok.json()["count"] == len(engine.tokenizer.encode(" x" * 10))
    for reply, field in ((prompt, "prompt"), (messages, "messages")):
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["message"].startswith(f"{field}: ")
        assert f"more than this model's context ({MAX_MODEL_LEN})" in reply.json()["error"]["message"]
