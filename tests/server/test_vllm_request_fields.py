"""Request fields vLLM accepts: stream_options.continuous_usage_stats (usage in every chunk, counted
as the tokens so far), and OpenAI's metadata (checked, stored nowhere). The app in-process on
dummy:tiny, read through the official openai client; the reference is the chunks' own token ids
(logprobs) and the prompt's length."""

from __future__ import annotations

import asyncio

import httpx2
import openai
import pytest

from goodserve.config import EngineConfig
from goodserve.engine.frontend.async_engine import AsyncEngine
from goodserve.server.app import ServerConfig, build_app
from goodserve.server.protocol import ChatCompletionRequest

PROMPT = [5, 6, 7, 8, 9]
REQUEST = dict(model="dummy:tiny", prompt=PROMPT, max_tokens=6, logprobs=0, temperature=0, stream=True,
               extra_body={"ignore_eos": True})


async def _stream(tmp_path, **options) -> list:
    engine = AsyncEngine(EngineConfig(model="dummy:tiny", num_kv_blocks=32, max_model_len=128))
    app = build_app(engine, ServerConfig(data_dir=str(tmp_path)))
    async with app.router.lifespan_context(app):
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://app") as http:
            client = openai.AsyncOpenAI(base_url="http://app/v1", api_key="none", http_client=http)
            stream = await client.completions.create(stream_options=options, **REQUEST)
            return [chunk async for chunk in stream]


def test_continuous_usage_stats_put_the_tokens_so_far_in_every_chunk(tmp_path):
    chunks = asyncio.run(_stream(tmp_path, include_usage=True, continuous_usage_stats=True))
    content, last = chunks[:-1], chunks[-1]
    sent = 0
    for chunk in content:
        sent += len(chunk.choices[0].logprobs.tokens)
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (len(PROMPT), sent)
        assert chunk.usage.total_tokens == len(PROMPT) + sent
    assert sent == 6 and last.choices == [] and last.usage.completion_tokens == 6


def test_without_continuous_usage_stats_only_the_last_chunk_has_usage(tmp_path):
    chunks = asyncio.run(_stream(tmp_path, include_usage=True))
    assert all(chunk.usage is None for chunk in chunks[:-1]) and chunks[-1].usage.completion_tokens == 6


def test_metadata_is_accepted_within_openais_limits():
    messages = [{"role": "user", "content": "hi"}]
    ChatCompletionRequest(messages=messages, metadata={"team": "search", "run": "42"})
    for bad in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 1}):
        with pytest.raises(ValueError):
            ChatCompletionRequest(messages=messages, metadata=bad)
