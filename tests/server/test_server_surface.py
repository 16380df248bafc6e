"""The OpenAI surface beyond chat and completions, on loopback with the embedded model and the official
openai client: logit_bias, echo, embeddings, /v1/models/{id}, /version, Responses, and the contract
(a field goodserve does not implement is a 400 naming it).

References: LLM.generate in this process (same float32 weights), transformers' hidden states for
embeddings, the engine's prompt_logprobs for echo."""

from __future__ import annotations

import base64
import json
import logging
from importlib.metadata import version

import httpx2
import numpy as np
import openai
import pytest
import torch

from goodserve import SamplingParams
from goodserve.server.contract import check_fields
from goodserve.server.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, ResponsesRequest
from helpers import HTTP_TIMEOUT_S, InProcessServer

MODEL = "smollm2-135m"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served(embedded_llm):
    """The server on the embedded model in float32, and the same model in this process (the reference)."""
    with InProcessServer(["--max-model-len", "512", "--quantization", "none"]) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        yield server, embedded_llm, client


def test_logit_bias_bans_the_greedy_token_and_forces_another(served):
    _, llm, client = served
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0)
    first = llm.tokenizer.encode(plain.choices[0].logprobs.tokens[0], add_special_tokens=False)[0]
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                       logit_bias={str(first): -100})
    expected = llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0, logit_bias={first: -100}))[0]
    assert banned.choices[0].text == expected.outputs[0].text != plain.choices[0].text
    assert expected.outputs[0].token_ids[0] != first
    forced = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0.8, seed=3,
                                          logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == " banana" * 4
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=MODEL, prompt=PROMPT, logit_bias={"49152": 1})  # past the vocabulary
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=MODEL, prompt=PROMPT, logit_bias={"5": 101})


def test_echo_returns_the_prompt_and_its_prompt_logprobs(served):
    _, llm, client = served
    ids = llm.tokenizer.encode(PROMPT)
    reference = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1,
                                                                       logprobs=1))[0]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == PROMPT + reference.outputs[0].text
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids) + 2
    expected = [entry[t].logprob for t, entry in zip(ids[1:], reference.prompt_logprobs[1:])]
    expected += [entry[t].logprob for t, entry in zip(reference.outputs[0].token_ids, reference.outputs[0].logprobs)]
    np.testing.assert_allclose(lp.token_logprobs[1:], expected, atol=1e-4)
    assert lp.text_offset[len(ids)] == len(PROMPT)
    scored = client.completions.create(model=MODEL, prompt=[ids], max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].text == llm.tokenizer.decode(ids) and scored.usage.completion_tokens == 0
    np.testing.assert_allclose(scored.choices[0].logprobs.token_logprobs[1:], expected[: len(ids) - 1], atol=1e-4)
    stream = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True,
                                            logprobs=1, stream=True))
    assert stream[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in stream) == choice.text
    assert sum((c.choices[0].logprobs.token_logprobs for c in stream), []) == lp.token_logprobs
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="at least 1"):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="'suffix'"):
        client.completions.create(model=MODEL, prompt=PROMPT, suffix="!")


@pytest.mark.slow  # transformers loads the embedded model (~11 s)
@torch.no_grad()
def test_embeddings_equal_transformers_last_token_hidden_state(served, hf_embedded):
    _, llm, client = served
    texts = ["Hello world", "A much longer sentence about the sea and the boats in the harbour."]
    ids = [llm.tokenizer.encode(t) for t in texts]
    expected = []
    for prompt in ids:
        last = hf_embedded.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        expected.append((last / last.norm()).numpy())
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert floats.usage.prompt_tokens == sum(map(len, ids)) and [d.index for d in floats.data] == [0, 1]
    np.testing.assert_allclose(np.array([d.embedding for d in floats.data]), expected, atol=2e-4)
    by_default = client.embeddings.create(model=MODEL, input=ids)  # the client asks for base64 and decodes it
    np.testing.assert_allclose(np.array([d.embedding for d in by_default.data]), expected, atol=2e-4)
    raw = httpx2.post(f"{client.base_url}embeddings", json={"input": ids[0], "encoding_format": "base64"},
                      timeout=HTTP_TIMEOUT_S).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, expected[0], atol=2e-4)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=MODEL, input="hi", dimensions=8)
    assert len(client.embeddings.create(model=MODEL, input="hi", dimensions=576).data[0].embedding) == 576


def test_model_by_id_and_version(served):
    server, _, client = served
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
    assert httpx2.get(f"{server.url}/version", timeout=HTTP_TIMEOUT_S).json() == {"version": version("goodserve")}


def test_responses_non_stream_and_stream_equal_the_chat_path(served):
    _, llm, client = served
    instructions, question = "Answer in one word.", "What is the capital of France?"
    messages = [{"role": "system", "content": instructions}, {"role": "user", "content": question}]
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    response = client.responses.create(model=MODEL, instructions=instructions, input=question,
                                       max_output_tokens=8, temperature=0)
    assert response.output_text == expected and response.usage.output_tokens > 0
    cut = client.responses.create(model=MODEL, input=question, max_output_tokens=1, temperature=0)
    assert (cut.status, cut.incomplete_details.reason, cut.output[0].status) == (
        "incomplete", "max_output_tokens", "incomplete")
    events = list(client.responses.create(model=MODEL, input=[{"role": "system", "content": instructions},
                                                               {"role": "user", "content": question}],
                                          max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    assert next(e for e in events if e.type == "response.output_text.done").text == expected
    assert events[-1].response.output_text == expected
    for field, value in (("previous_response_id", "resp_1"), ("store", True)):
        with pytest.raises(openai.BadRequestError, match=field):
            client.responses.create(model=MODEL, input="hi", **{field: value})
    with pytest.raises(openai.BadRequestError, match="tool type 'web_search' is not supported"):
        client.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="input item type 'reasoning' is not supported"):
        client.responses.create(model=MODEL, input=[{"type": "reasoning", "id": "rs_1", "summary": []}])


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_responses_text_format_follows_a_json_schema_as_the_chat_path_does(served):
    _, _, client = served
    question = [{"role": "user", "content": "Name a city in France."}]
    chat = client.chat.completions.create(model=MODEL, messages=question, max_tokens=24, temperature=0,
                                          response_format={"type": "json_schema", "json_schema": {
                                              "name": "place", "schema": WEATHER}})
    response = client.responses.create(model=MODEL, input=question, max_output_tokens=24, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "place", "schema": WEATHER}})
    assert response.output_text == chat.choices[0].message.content
    assert json.loads(response.output_text)["city"] and response.text.format.type == "json_schema"


@pytest.mark.slow  # three grammar-bound generations; the fast tier keeps the Responses API's other checks
def test_responses_function_calls_equal_the_chat_paths_and_their_outputs_come_back(served):
    _, _, client = served
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}
    chat_tool = {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
    chat = client.chat.completions.create(model=MODEL, messages=question, tools=[chat_tool], tool_choice="required",
                                          max_tokens=40, temperature=0)
    (expected,) = chat.choices[0].message.tool_calls
    response = client.responses.create(model=MODEL, input=question, tools=[tool], tool_choice="required",
                                       max_output_tokens=40, temperature=0)
    (call,) = response.output  # the call alone: no message item
    assert (call.type, call.name, call.arguments) == ("function_call", "get_weather", expected.function.arguments)
    assert json.loads(call.arguments)["city"] and call.call_id.startswith("call_")
    assert response.tool_choice == "required" and response.tools[0].name == "get_weather"

    events = list(client.responses.create(model=MODEL, input=question, tools=[tool], tool_choice="required",
                                          max_output_tokens=40, temperature=0, stream=True))
    assert "response.output_text.delta" not in [e.type for e in events]
    added = next(e for e in events if e.type == "response.output_item.added")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert added.item.type == "function_call" and done.item_id == added.item.id
    assert done.arguments == call.arguments == events[-1].response.output[0].arguments
    with client.responses.stream(model=MODEL, input=question, tools=[tool], tool_choice="required",
                                 max_output_tokens=40, temperature=0) as stream:
        rebuilt = stream.get_final_response()  # the client's own accumulator, which checks the events' order
    assert rebuilt.output[0].arguments == call.arguments

    # the next turn: the call and what the function returned, as the chat path sends them
    result = '{"temperature_c": 21, "sky": "clear"}'
    items = [*question, {"type": "function_call", "call_id": call.call_id, "name": call.name,
                         "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": result}]
    turn = client.responses.create(model=MODEL, tools=[tool], max_output_tokens=12, temperature=0, input=items)
    streamed = list(client.responses.create(model=MODEL, tools=[tool], max_output_tokens=12, temperature=0,
                                            input=items, stream=True))
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == turn.output_text
    reply = client.chat.completions.create(model=MODEL, tools=[chat_tool], max_tokens=12, temperature=0, messages=[
        *question, {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result}])
    assert turn.output_text == reply.choices[0].message.content and turn.output_text  # a text answer


BODIES = {"/v1/chat/completions": ({"messages": CHAT, "max_tokens": 1}, ChatCompletionRequest),
          "/v1/completions": ({"prompt": "hi", "max_tokens": 1}, CompletionRequest),
          "/v1/responses": ({"input": "hi", "max_output_tokens": 1}, ResponsesRequest),
          "/v1/embeddings": ({"input": "hi"}, EmbeddingRequest)}
REFUSED = [(path, body, name) for path, (body, schema) in BODIES.items()
           for name in sorted(schema.unsupported) + ["frobnicate"]]


def test_every_unimplemented_field_is_refused_by_name(served):
    server, _, client = served
    with httpx2.Client(base_url=server.url, timeout=HTTP_TIMEOUT_S) as http:
        for path, body, name in REFUSED:
            resp = http.post(path, json={**body, name: "x"})
            assert resp.status_code == 400, (path, name, resp.text)
            error = resp.json()["error"]
            assert f"'{name}'" in error["message"] and error["param"] == name, (path, name, error)
        # stream_options is strict: an option it does not know would otherwise look accepted and never apply
        resp = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "stream": True, "stream_options": {
            "include_usage": True, "usage_every_token": True}})
        assert resp.status_code == 400 and "stream_options.usage_every_token" in resp.json()["error"]["message"]
        # a null is no value; the other helper's structured-output fields stay accepted until they land
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "best_of": None}).status_code == 200
        assert http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1,
                                                       "response_format": {"type": "text"}}).status_code == 200
    # the client's plain calls send nothing refused
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    client.completions.create(model=MODEL, prompt="hi", max_tokens=1)


def test_a_content_part_the_model_cannot_read_is_refused_by_its_type(served):
    _, _, client = served
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    with pytest.raises(openai.BadRequestError, match="content part type 'image_url' is not supported"):
        client.chat.completions.create(model=MODEL, max_tokens=1,
                                       messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}])
    with pytest.raises(openai.BadRequestError, match="content part type 'input_image' is not supported"):
        client.responses.create(model=MODEL, max_output_tokens=1, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/cat.png"}]}])
    # text parts are read as before
    parts = client.chat.completions.create(model=MODEL, max_tokens=3, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]}])
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0)
    assert parts.choices[0].message.content == plain.choices[0].message.content


SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def test_continue_final_message_continues_the_assistants_text(served):
    server, llm, client = served
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    # the prompt by hand: SmolLM2's template up to the last message's text, no end of turn after it
    prompt = (SMOL_SYSTEM + "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
              "<|im_start|>assistant\nThe capital of France is")
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    expected = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].text
    continued = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                               extra_body={"continue_final_message": True,
                                                           "add_generation_prompt": False})
    assert continued.choices[0].message.content == expected and continued.usage.prompt_tokens == len(ids)
    offline = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), add_generation_prompt=False,
                       continue_final_message=True)
    assert offline[0].outputs[0].text == expected
    tokenized = httpx2.post(f"{server.url}/tokenize", json={"messages": messages, "continue_final_message": True,
                                                            "add_generation_prompt": False},
                            timeout=HTTP_TIMEOUT_S).json()
    assert tokenized["tokens"] == ids
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt to false"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                       extra_body={"continue_final_message": True})


def test_chat_template_kwargs_the_template_does_not_read_are_refused_by_name(served):
    _, _, client = served
    with pytest.raises(openai.BadRequestError, match="'enable_thinking' is not a variable of this model's chat"):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    # false is what the unread variable means already: accepted, as clients send it to every model
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    with pytest.raises(openai.BadRequestError, match="may not set 'messages'"):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"messages": []}})
    # empty: nothing to pass, accepted
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body={"chat_template_kwargs": {}})


def test_allow_unknown_fields_ignores_unknown_but_not_unimplemented_fields(caplog):
    chat = ChatCompletionRequest(messages=CHAT, frobnicate=1, service_tier="flex")
    with pytest.raises(Exception, match="'service_tier'"):
        check_fields(chat, chat.unsupported, allow_unknown=True)
    lenient = ChatCompletionRequest(messages=CHAT, frobnicate=1)
    with caplog.at_level(logging.WARNING, logger="goodserve.server"):
        check_fields(lenient, lenient.unsupported, allow_unknown=True)
    assert "frobnicate" in caplog.text
    with pytest.raises(Exception, match="unknown field 'frobnicate'.*--allow-unknown-fields"):
        check_fields(lenient, lenient.unsupported, allow_unknown=False)
    check_fields(EmbeddingRequest(input="hi", user="u"), frozenset(), allow_unknown=False)


def test_serve_flags_reach_the_server_config():
    import argparse

    from goodserve.engine_args import dataclass_from_args
    from goodserve.server import command
    from goodserve.server.app import ServerConfig

    parser = argparse.ArgumentParser()
    command.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--allow-unknown-fields", "--pooling", "mean"])
    config = dataclass_from_args(ServerConfig, args)
    assert config.allow_unknown_fields and config.pooling == "mean"
    assert not dataclass_from_args(ServerConfig, parser.parse_args(["serve"])).allow_unknown_fields
