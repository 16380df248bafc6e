"""Streaming OpenAI client over aiohttp: one request in, one RequestRecord out, never an exception.

It speaks /v1/completions and /v1/chat/completions as any OpenAI-compatible server does (goodserve,
vLLM, SGLang, TGI, hosted APIs): SSE chunks `data: {...}` ending with `data: [DONE]`, with
`stream_options.include_usage` so the server's own token counts come back in the last chunk.

Why aiohttp: a load generator's own time per event delays the events it times. At 60 req/s of
256-chunk streams from a stand-in that answers in 20 ms (benchmarks/cpu_router_relay.py
--bench-client), this client on httpx2 spent 86 us of CPU an event (each read through anyio's cancel
scopes) and reported TTFT median / p99 27 / 200 ms; on aiohttp 45 us and 22 / 34 ms.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlsplit

import aiohttp

from goodserve.bench.records import RequestRecord
from goodserve.bench.workloads import BenchRequest
from goodserve.errors import InvalidRequestError

Clock = Callable[[], float]


@dataclass
class HttpTargetConfig:
    base_url: str
    endpoint: str = "/v1/completions"
    model: str = "default"
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    timeout_s: float = 600.0
    extra_body: dict | None = None
    headers: dict[str, str] = field(default_factory=dict)  # sent with every request (vLLM's --header)

    @property
    def is_chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/" + self.endpoint.lstrip("/")


def check_reachable(base_url: str, wait_s: float = 0.0) -> None:
    """Fail before a run, not with a table of zeros after it, when nothing listens at base_url;
    wait_s: how long to keep trying (a server still starting)."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequestError(f"--base-url {base_url!r}: expected http://HOST:PORT or https://HOST:PORT")
    address = (parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection(address, timeout=5.0):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise InvalidRequestError(
                    f"nothing answers at {base_url} ({exc.strerror or exc}): start the server first (e.g. "
                    f"`goodserve serve`), or point --base-url / --host / --port at it; "
                    f"--ready-check-timeout-sec N waits for one that is starting") from None
            time.sleep(1.0)


class TokenCounter:
    """Counts generated tokens when the server reports no usage; None falls back to chunk counts."""

    def __init__(self, encode: Callable[[str], list[int]] | None):
        self.encode = encode

    def count(self, text: str, num_chunks: int) -> tuple[int, str]:
        if self.encode is not None:
            return len(self.encode(text)), "tokenizer"
        return num_chunks, "chunks"


class HttpTarget:
    """Sends each BenchRequest as one streaming request and times every chunk."""

    def __init__(self, config: HttpTargetConfig, counter: TokenCounter, max_connections: int = 1024):
        self.config = config
        self.counter = counter
        self.max_connections = max_connections
        self.session: aiohttp.ClientSession | None = None  # made in the running loop, which it binds to

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:
            headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
            headers.update(self.config.headers)
            # timeout_s bounds each wait for bytes, not the whole stream (a long answer may stream for minutes)
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=self.config.timeout_s)
            self.session = aiohttp.ClientSession(headers=headers, timeout=timeout,
                                                 connector=aiohttp.TCPConnector(limit=self.max_connections))
        return self.session

    @property
    def description(self) -> str:
        return self.config.url

    def payload(self, request: BenchRequest) -> dict:
        c = self.config
        body: dict = {"model": c.model, "stream": True, "stream_options": {"include_usage": True},
                      "temperature": c.temperature, "max_tokens": request.output_len}
        if c.is_chat:
            body["messages"] = request.chat_messages()
            body["max_completion_tokens"] = request.output_len
        else:
            body["prompt"] = request.completion_prompt()
        if c.ignore_eos:
            body["ignore_eos"] = True  # vLLM/goodserve extension; other servers ignore unknown fields
        body.update(c.extra_body or {})
        return body

    async def send(self, request: BenchRequest, index: int, clock: Clock) -> RequestRecord:
        record = RequestRecord(index=index, prompt_len=request.prompt_len,
                               expected_output_len=request.output_len, send_time=clock(),
                               conversation_id=request.conversation_id)
        stream = _StreamState()
        try:
            async with self._session().post(self.config.url, json=self.payload(request)) as response:
                if response.status != 200:
                    body = (await response.read()).decode("utf-8", "replace")
                    record.error = f"HTTP {response.status}: {_error_message(body)}"
                else:
                    await self._read_events(response, stream, clock)
                    record.error = stream.problem()
        except aiohttp.ClientConnectorError as exc:
            record.error = f"cannot connect to {self.config.url}: {exc or type(exc).__name__}"
        except asyncio.TimeoutError as exc:  # aiohttp's read and connect timeouts are TimeoutErrors
            record.error = f"timed out after {self.config.timeout_s:g}s: {type(exc).__name__}"
        except (aiohttp.ClientError, json.JSONDecodeError) as exc:
            record.error = (f"stream broke after {len(stream.chunk_times)} chunks: "
                            f"{type(exc).__name__}: {exc}")
        record.end_time = clock()
        self._finish(record, stream)
        return record

    async def _read_events(self, response: aiohttp.ClientResponse, stream: "_StreamState", clock: Clock) -> None:
        """SSE lines as the bytes come, each timed at the read that brought it. Split here rather than by
        the response's line iterator, which refuses a line past its buffer (a chunk with many
        logprobs can be one)."""
        pending = b""
        async for data in response.content.iter_any():
            now = clock()
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                if stream.feed(line.decode("utf-8").rstrip("\r"), now, self.config.is_chat):
                    return
        if pending:
            stream.feed(pending.decode("utf-8"), clock(), self.config.is_chat)

    def _finish(self, record: RequestRecord, stream: "_StreamState") -> None:
        if not record.error and not stream.chunk_times:
            # Tokens that decode to no text (usage says they exist): seen when the stream ends.
            stream.chunk_times.append(record.end_time)
        record.chunk_times = stream.chunk_times
        record.first_token_time = stream.chunk_times[0] if stream.chunk_times else None
        record.generated_text = "".join(stream.texts)
        record.success = not record.error
        if stream.usage:
            record.prompt_len = int(stream.usage.get("prompt_tokens") or record.prompt_len)
            record.output_len = int(stream.usage.get("completion_tokens") or 0)
            record.output_len_source = "usage"
            details = stream.usage.get("prompt_tokens_details") or {}
            record.cached_tokens = details.get("cached_tokens")
        else:
            record.output_len, record.output_len_source = self.counter.count(
                record.generated_text, len(stream.chunk_times))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


class _StreamState:
    """What the SSE stream has said so far."""

    def __init__(self) -> None:
        self.chunk_times: list[float] = []
        self.texts: list[str] = []
        self.usage: dict | None = None
        self.done = False
        self.server_error = ""

    def feed(self, line: str, now: float, is_chat: bool) -> bool:
        """Consume one SSE line; True once the stream is over."""
        if not line.startswith("data:"):
            return False  # blank separators, comments, `event:` lines
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            self.done = True
            return True
        chunk = json.loads(data)
        if "error" in chunk:
            self.server_error = _error_message(json.dumps(chunk))
            return True
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content") if is_chat else choice.get("text")
            # A chunk counts as a token event if it carries text (role-only chat deltas do not).
            if text:
                self.chunk_times.append(now)
                self.texts.append(text)
        return False

    def problem(self) -> str:
        if self.server_error:
            return f"server error mid-stream: {self.server_error}"
        if not self.done:
            return f"stream ended without [DONE] after {len(self.chunk_times)} chunks"
        if not self.chunk_times and not (self.usage and self.usage.get("completion_tokens")):
            return "empty stream: the server sent [DONE] without any tokens"
        return ""


def _error_message(body: str) -> str:
    try:
        error = json.loads(body).get("error", body)
    except (json.JSONDecodeError, AttributeError):
        return body.strip()[:500]
    if isinstance(error, dict):
        return str(error.get("message", error))[:500]
    return str(error)[:500]


def monotonic_clock() -> Clock:
    start = time.perf_counter()
    return lambda: time.perf_counter() - start
