"""`goodserve serve` on loopback with the embedded model, driven by the official openai client.

References: LLM.generate / LLM.chat in this process (same weights, no HTTP), the model's tokenizer,
and prometheus_client's own parser. One server for the whole module, in this process, run twice:
the engine on a thread (--no-engine-process), and in a process of its own (the default).
tests/e2e/test_serve_sigterm.py stops a server process of each kind with SIGTERM.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx2
import openai
import pytest

from goodserve import LLM, SamplingParams
from goodserve.server.process import scrape_metrics
from helpers import HTTP_TIMEOUT_S, InProcessServer

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 512
GREEDY = dict(temperature=0.0)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass
class Stack:
    server: InProcessServer
    llm: LLM
    client: openai.OpenAI

    @property
    def url(self) -> str:
        return self.server.url


# The engine on a thread is what the other server tests (tests/helpers.py InProcessServer) run on, so
# the fast tier runs this module on the engine in its own process (the server's default) and the full
# tier on both.
@pytest.fixture(scope="module", params=[pytest.param(["--no-engine-process"], marks=pytest.mark.slow),
                                        ["--engine-process"]], ids=["engine-thread", "engine-process"])
def stack(request, embedded_gguf_llm):
    """The server (the embedded model as the CPU serves it by default) and the same model in this process."""
    with InProcessServer(["--max-model-len", str(MAX_MODEL_LEN), "--slo-ttft-ms", "600000", *request.param]) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        yield Stack(server, embedded_gguf_llm, client)


def reference(llm: LLM, prompt: str, **params) -> str:
    return llm.generate([prompt], SamplingParams(**params))[0].outputs[0].text


def test_startup_log_names_model_dtype_device_pool_and_url(stack):
    log = stack.server.log()
    line = next(line for line in log.splitlines() if "serving " in line)
    for expected in (MODEL, "dtype=float32", "device=cpu", "blocks x 16", "tokens", stack.url):
        assert expected in line, (expected, line)


def test_models_lists_the_served_model(stack):
    models = stack.client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_chat_non_stream_equals_llm_chat_and_counts_tokens(stack):
    resp = stack.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, **GREEDY)
    expected = stack.llm.chat(CHAT, SamplingParams(max_tokens=8, **GREEDY))[0]
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    tok = stack.llm.tokenizer
    prompt_ids = tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True), add_special_tokens=False)
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_stream_equals_non_stream_with_usage(stack):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=8, **GREEDY)
    full = stack.client.chat.completions.create(**kwargs)
    chunks = list(stack.client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                       **kwargs))
    content_chunks = [c for c in chunks if c.choices]
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == full.choices[0].message.content
    assert content_chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.usage is None for c in content_chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_second_identical_prompt_reports_cached_tokens(stack):
    prompt = "A long shared prefix for the cache: " + "one two three four five six seven eight " * 6
    stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, **GREEDY)
    again = stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, **GREEDY)
    num_prompt = len(stack.llm.tokenizer.encode(prompt))
    cached = again.usage.prompt_tokens_details.cached_tokens
    # Whole 16-token blocks are cached; the last prompt token is always recomputed.
    assert (num_prompt - 1) // 16 * 16 == cached


def test_completions_list_prompt_equals_llm_generate(stack):
    prompts = ["The capital of Italy is", "1, 2, 3, 4,"]
    resp = stack.client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, **GREEDY)
    expected = stack.llm.generate(prompts, SamplingParams(max_tokens=6, **GREEDY))
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [e.outputs[0].text for e in expected]
    tok = stack.llm.tokenizer
    assert resp.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert resp.usage.completion_tokens == sum(len(e.outputs[0].token_ids) for e in expected)


def test_completions_token_id_prompt(stack):
    ids = stack.llm.tokenizer.encode("The capital of Italy is")
    resp = stack.client.completions.create(model=MODEL, prompt=ids, max_tokens=6, **GREEDY)
    assert resp.choices[0].text == reference(stack.llm, "The capital of Italy is", max_tokens=6, **GREEDY)


def test_n2_seeded_sampling_stream_equals_non_stream(stack):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, n=2, temperature=1.0, seed=1234)
    full = stack.client.completions.create(**kwargs)
    assert sorted(c.index for c in full.choices) == [0, 1]
    streamed = {0: "", 1: ""}
    for chunk in stack.client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == {c.index: c.text for c in full.choices}
    assert full.usage.completion_tokens == 12


def test_completion_logprobs_match_llm_generate(stack):
    prompt = "The capital of Italy is"
    resp = stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, logprobs=3, **GREEDY)
    expected = stack.llm.generate([prompt], SamplingParams(max_tokens=5, logprobs=3, **GREEDY))[0].outputs[0]
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(expected.token_ids) == resp.usage.completion_tokens
    assert "".join(lp.tokens) == resp.choices[0].text
    for i, token_id in enumerate(expected.token_ids):
        assert lp.token_logprobs[i] == pytest.approx(expected.logprobs[i][token_id].logprob, abs=1e-4)
        assert len(lp.top_logprobs[i]) <= 3
        # greedy: the chosen token is the most likely one
        assert lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values()), abs=1e-6)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_chat_logprobs_in_openai_format(stack):
    resp = stack.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, logprobs=True,
                                                top_logprobs=2, **GREEDY)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert bytes(t.bytes).decode() == t.token


def test_64_concurrent_streams_equal_sequential_runs(stack):
    prompts = [f"Item {i}: the number {i} plus one is" for i in range(64)]
    sequential = [
        stack.client.completions.create(model=MODEL, prompt=p, max_tokens=3, **GREEDY).choices[0].text
        for p in prompts
    ]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, stream=True, **GREEDY)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_at_once() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(all_at_once()) == sequential


def _wait_for_idle_engine(url: str, timeout_s: float = 120.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape_metrics(url)
        if m["goodserve:num_requests_running{}"] == 0 and m["goodserve:num_used_kv_blocks{}"] == 0:
            return m
        assert time.monotonic() < deadline, f"engine still busy: {m}"
        time.sleep(0.1)


def test_disconnected_streams_are_aborted_and_free_their_blocks(stack):
    aborted_before = scrape_metrics(stack.url).get("goodserve:request_success_total{finished_reason=abort}", 0)
    body = {"model": MODEL, "prompt": "Tell me a very long story about dragons.", "max_tokens": 400,
            "ignore_eos": True, "stream": True}

    async def read_one_chunk_and_hang_up(client: httpx2.AsyncClient) -> None:
        async with client.stream("POST", f"{stack.url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    return  # leaving the block closes the connection mid-stream

    async def twenty_clients() -> None:
        async with httpx2.AsyncClient(timeout=HTTP_TIMEOUT_S) as client:
            await asyncio.gather(*(read_one_chunk_and_hang_up(client) for _ in range(20)))

    asyncio.run(twenty_clients())
    m = _wait_for_idle_engine(stack.url)
    assert m["goodserve:kv_cache_usage_perc{}"] == 0
    assert m["goodserve:request_success_total{finished_reason=abort}"] - aborted_before == 20
    after = stack.client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, **GREEDY)
    assert after.choices[0].text == reference(stack.llm, "Hello", max_tokens=3, **GREEDY)


def test_metrics_parse_and_counters_move(stack):
    before = scrape_metrics(stack.url)
    prompt = "Counting tokens for the metrics test"
    resp = stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, **GREEDY)
    after = scrape_metrics(stack.url)

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0)

    assert moved("goodserve:prompt_tokens_total{}") == len(stack.llm.tokenizer.encode(prompt))
    assert moved("goodserve:generation_tokens_total{}") == resp.usage.completion_tokens
    assert moved(f"goodserve:request_success_total{{finished_reason={resp.choices[0].finish_reason}}}") == 1
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert moved(f"goodserve:{hist}_count{{}}") == 1, hist
    assert moved("goodserve:request_generation_tokens_sum{}") == resp.usage.completion_tokens
    assert moved("goodserve:inter_token_latency_seconds_count{}") == resp.usage.completion_tokens - 1
    assert moved("goodserve:request_slo_total{attained=true}") == 1  # a 600 s TTFT target is met
    assert moved("goodserve:engine_steps_total{}") >= resp.usage.completion_tokens
    assert moved("goodserve:prefix_cache_queries_total{}") >= len(stack.llm.tokenizer.encode(prompt)) - 1
    assert moved("goodserve:step_time_seconds_total{phase=forward}") > 0
    for gauge in ("num_requests_waiting", "kv_cache_usage_perc", "batch_fill_ratio", "num_preemptions_total",
                  "prefix_cache_hits_total", "step_time_prediction_error"):
        assert any(name.startswith(f"goodserve:{gauge}{{") for name in after), gauge


def test_tokenize_and_detokenize(stack):
    text = "Hello, tokenizer!"
    tokens = httpx2.post(f"{stack.url}/tokenize", json={"model": MODEL, "prompt": text}, timeout=HTTP_TIMEOUT_S).json()
    assert tokens["tokens"] == stack.llm.tokenizer.encode(text)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    back = httpx2.post(f"{stack.url}/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]},
                       timeout=HTTP_TIMEOUT_S).json()
    assert back["prompt"] == stack.llm.tokenizer.decode(tokens["tokens"])
    chat = httpx2.post(f"{stack.url}/tokenize", json={"messages": CHAT}, timeout=HTTP_TIMEOUT_S).json()
    usage = stack.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens


BAD_REQUESTS = [
    # (name, path, raw body or json, expected status)
    ("malformed json", "/v1/completions", b'{"model": "smollm2-135m", "prompt": ', 400),
    ("wrong field type", "/v1/completions", {"prompt": "hi", "max_tokens": "lots"}, 422),
    ("messages not a list", "/v1/chat/completions", {"messages": "hi"}, 422),
    ("negative max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400),
    ("huge max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": 10**12}, 400),
    ("prompt over the context", "/v1/completions", {"prompt": "word " * (MAX_MODEL_LEN + 10)}, 400),
    ("token ids out of vocab", "/v1/completions", {"prompt": [1, 2, 10**9]}, 400),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-17", "messages": CHAT}, 404),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 422),
    ("bad temperature", "/v1/chat/completions", {"messages": CHAT, "temperature": -1}, 400),
    ("n too large", "/v1/completions", {"prompt": "hi", "n": 1000}, 400),
    ("unknown route", "/v1/engines", {"prompt": "hi"}, 404),
]


@pytest.mark.parametrize("name,path,body,status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_typed_error_and_server_stays_healthy(stack, name, path, body, status):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    resp = httpx2.post(f"{stack.url}{path}", timeout=HTTP_TIMEOUT_S, **kwargs)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["message"] and error["type"] and error["code"] == status
    assert "Traceback" not in resp.text
    assert httpx2.get(f"{stack.url}/health", timeout=HTTP_TIMEOUT_S).status_code == 200


def test_bad_input_through_the_openai_client_raises_its_typed_errors(stack):
    with pytest.raises(openai.NotFoundError):
        stack.client.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        stack.client.completions.create(model=MODEL, prompt="hi", max_tokens=MAX_MODEL_LEN)


def test_schemathesis_finds_no_server_errors(stack):
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(f"{stack.url}/openapi.json")
    bounded = {"max_tokens": 2, "max_completion_tokens": 2, "n": 1, "min_tokens": 0}
    checked = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path in ("/metrics", "/health"):
            continue
        modes = [schemathesis.GenerationMode.POSITIVE]
        if operation.body:  # an operation without a body (a GET, a batch's cancel) has nothing to get wrong
            modes.append(schemathesis.GenerationMode.NEGATIVE)
        for mode in modes:

            @settings(max_examples=5, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def no_server_error(case) -> None:
                if isinstance(case.body, dict):  # keep CPU generation short; other fields stay random
                    case.body.update(bounded)
                response = case.call(base_url=stack.url, timeout=HTTP_TIMEOUT_S)
                assert response.status_code < 500, (operation.path, case.body, response.text)

            no_server_error()
        checked.append(operation.path)
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"} <= set(checked)
    assert httpx2.get(f"{stack.url}/health", timeout=HTTP_TIMEOUT_S).status_code == 200
