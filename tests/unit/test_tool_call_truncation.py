"""A forced tool call cut by max_tokens is reported as cut: finish_reason "length" with the calls that
were complete (a named call: its arguments as far as they came, as OpenAI returns one), never the
truncated JSON as the message's content. The reference is the calls written out by hand."""

from __future__ import annotations

import json

from goodserve.server.protocol import ChatCompletionRequest
from goodserve.server.serving_chat import _ChoiceStream
from goodserve.server.tool_calls import output_calls

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PARIS = {"name": "get_weather", "arguments": {"city": "Paris"}}
CUT = json.dumps([PARIS, PARIS])[:-20]  # the second call cut inside its arguments


def request(tool_choice) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "weather?"}], tools=[TOOL],
                                 tool_choice=tool_choice)


def test_a_cut_required_array_returns_its_complete_calls():
    content, calls = output_calls(request("required"), "required", CUT, truncated=True)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert output_calls(request("required"), "required", "[", truncated=True) == (None, [])
    # Not cut, yet not JSON (cannot happen under the grammar): the text stays the content.
    assert output_calls(request("required"), "required", CUT) == (CUT, [])


def test_a_cut_named_call_keeps_its_partial_arguments():
    named = {"type": "function", "function": {"name": "get_weather"}}
    content, calls = output_calls(request(named), "named", '{"city": "Pa', truncated=True)
    assert content is None and (calls[0].name, calls[0].arguments) == ("get_weather", '{"city": "Pa')


def test_a_cut_required_stream_sends_the_complete_calls_not_the_text():
    stream = _ChoiceStream(request("required"), "required")
    assert stream.feed(CUT[:10], final=False) == (None, [])
    content, calls = stream.feed(CUT[10:], final=True, truncated=True)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
