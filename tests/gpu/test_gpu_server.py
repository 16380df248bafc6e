"""`goodserve serve` on the GPU with the embedded model: a chat completion through the official
openai client, streamed and not, and /metrics through prometheus_client's parser; with the engine on
a thread of the server's process (--no-engine-process) and in a process of its own (the default),
which must give the same greedy reply."""

from __future__ import annotations

import openai
import pytest

from goodserve.server.process import launch_server, scrape_metrics

MODEL = "smollm2-135m"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


REPLIES: dict[str, str] = {}


@pytest.fixture(scope="module", params=[["--no-engine-process"], []], ids=["engine-thread", "engine-process"])
def server(request, device, cuda_only):
    server = launch_server(["--model", MODEL, "--device", "cuda", "--num-kv-blocks", "256", "--max-num-seqs", "8",
                            "--max-num-batched-tokens", "512", "--max-model-len", "1024", *request.param])
    try:
        yield server
    finally:
        server.stop()


def test_chat_stream_and_non_stream_agree_and_metrics_parse(server, record_property):
    startup = next(line for line in server.log().splitlines() if "serving " in line)
    assert "device=cuda" in startup, startup
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=16, temperature=0.0)
    full = client.chat.completions.create(**kwargs)
    content = full.choices[0].message.content
    assert content and full.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    record_property("reply", content)
    REPLIES[str(server.process.args)] = content
    assert len(set(REPLIES.values())) == 1, REPLIES  # the engine's process does not change its tokens

    metrics = scrape_metrics(server.url)
    assert metrics["goodserve:request_success_total{finished_reason=" + full.choices[0].finish_reason + "}"] == 2
    assert metrics["goodserve:generation_tokens_total{}"] == 2 * full.usage.completion_tokens
    assert metrics["goodserve:num_requests_running{}"] == 0
