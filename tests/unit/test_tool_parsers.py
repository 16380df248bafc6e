"""Tool calls found in hand-written model text: Hermes <tool_call> blocks and Llama-3 JSON, whole and
streamed at every chunk boundary (the streamed deltas must add up to the same calls and content)."""

import json

import pytest

from goodserve.server.tool_parsers import ToolCallStream, parse_tool_calls

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": {"n": 3}}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
LLAMA = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'


def test_hermes_blocks_become_calls_and_the_text_before_them_content():
    content, calls = parse_tool_calls(HERMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": {"n": 3}}), ("get_time", {})]


def test_llama_json_and_plain_text():
    assert [(c.name, json.loads(c.arguments)) for c in parse_tool_calls(LLAMA)[1]] == [("get_weather", {"city": "Oslo"})]
    assert parse_tool_calls("<|python_tag|>" + LLAMA)[1][0].name == "get_weather"
    assert parse_tool_calls("No tools needed: 4.") == ("No tools needed: 4.", [])
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a": </tool_call>')[1] == []  # broken JSON: text
    assert parse_tool_calls("{not json}") == ("{not json}", [])


def stream(text: str, size: int):
    parser, content, calls = ToolCallStream(), "", {}
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    for i, piece in enumerate(pieces):
        delta, deltas = parser.feed(piece, final=i == len(pieces) - 1)
        content += delta
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": None, "arguments": "", "id": None})
            if "id" in d:
                assert call["id"] is None and call["arguments"] == ""  # the header comes first, once
                call["id"], call["name"] = d["id"], d["function"]["name"]
            call["arguments"] += d["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 1000])
def test_streamed_deltas_add_up_at_every_chunk_size(size):
    content, calls = stream(HERMES, size)
    assert content.strip() == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": {"n": 3}}), ("get_time", {})]
    assert len({c["id"] for c in calls}) == 2
    content, calls = stream(LLAMA, size)
    assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert stream("Paris is <b>nice</b> <tool", size) == ("Paris is <b>nice</b> <tool", [])


def test_arguments_stream_before_the_call_is_closed():
    parser = ToolCallStream()
    parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    _, deltas = parser.feed('is"')
    assert deltas == [{"index": 0, "function": {"arguments": 'is"'}}]


def test_a_template_that_knows_tools_gets_them_and_object_arguments():
    from goodserve.server.protocol import ChatCompletionRequest
    from goodserve.server.tool_calls import conversation, prompt_tools

    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]})
    messages, kwargs = conversation(req.messages, prompt_tools(req), "{% for t in tools %}{% endfor %}")
    assert kwargs["tools"][0]["function"]["name"] == "w"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    fallback, kwargs = conversation(req.messages, prompt_tools(req), "{{ messages }}")
    assert kwargs == {} and fallback[0]["role"] == "system" and '"name": "w"' in fallback[0]["content"]
    assert fallback[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "w", "arguments": {"city": "Oslo"}}\n</tool_call>'}
