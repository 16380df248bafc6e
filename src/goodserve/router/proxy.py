"""A request through the router: pick a healthy replica, send, relay the response byte for byte.

A request is sent again to another replica only when it never started on the first: the connection
was refused or reset before any response byte came, or the replica answered 503 (it is draining or
at its connection cap) while another is left to try. Once a response has begun it is relayed as it
arrives (SSE chunk by chunk) and never retried: a break then reaches the client as a broken stream.
"""

from __future__ import annotations

import logging

import aiohttp
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.responses import Response

from goodserve.router.backend import Backend
from goodserve.router.metrics import NO_BACKEND, RouterMetrics
from goodserve.router.prefix_tree import PrefixTree
from goodserve.router.prompt_text import prompt_text

logger = logging.getLogger("goodserve.router")

# Raised by request() before the response's headers: the replica never answered the request (refused,
# timed out connecting, reset or closed before answering).
NEVER_STARTED = aiohttp.ClientConnectionError
# Of those, the ones that say the replica is gone (no connection at all); a reset of one kept-alive
# connection may be a race with its idle expiry, left for the health check to judge.
UNREACHABLE = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
# Per connection, not end to end: a proxy relays these itself.
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization",
              "proxy-authenticate", "host", "content-length", "date", "server"}


def _end_to_end(headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}


def no_backend_response() -> JSONResponse:
    return JSONResponse({"error": {"message": "no healthy replica could take the request", "type":
                                   "service_unavailable", "code": 503}}, status_code=503,
                        headers={"Retry-After": "1"})


class Router:
    def __init__(self, backends: list[Backend], policy, tree: PrefixTree, metrics: RouterMetrics,
                 connect_timeout_s: float):
        self.backends = backends
        self.policy = policy
        self.tree = tree
        self.metrics = metrics
        self.connect_timeout_s = connect_timeout_s
        self._client: aiohttp.ClientSession | None = None

    @property
    def client(self) -> aiohttp.ClientSession:
        """The replicas' HTTP client: aiohttp, whose streamed reads cost the router about half of what
        httpx2's did an event (benchmarks/cpu_router_relay.py). Made on first use, on the running
        loop. No read timeout: a long generation streams for minutes. No pool cap: the replicas'
        admission decides. Bodies as the replica sent them, encoding included."""
        if self._client is None:
            self._client = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s),
                auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding"))
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    def set_health(self, backend: Backend, healthy: bool, why: str = "") -> None:
        if backend.healthy == healthy:
            return
        backend.healthy = healthy
        if healthy:
            logger.info("replica %s is healthy again: back in rotation", backend.url)
        else:
            logger.warning("replica %s taken out: %s", backend.url, why)
            backend.scraped_requests = None
            self.tree.forget(backend.url)

    async def forward(self, method: str, path: str, body: bytes, headers) -> Response:
        """Routes POSTs by the policy; a GET (/v1/models) goes to the first healthy replica."""
        prompt = prompt_text(body) if method == "POST" else ""
        tried: set[str] = set()
        while candidates := [b for b in self.backends if b.healthy and b.url not in tried]:
            if tried:
                self.metrics.retries.inc()
            backend = self._choose(method, candidates, prompt)
            tried.add(backend.url)
            response = await self._send(backend, method, path, body, headers, len(prompt))
            if response is None:
                continue
            if response.status == 503 and len(candidates) > 1:  # draining: it did not run the request
                await self._done(backend, response, len(prompt), "http_error")
                continue
            return self._relay(backend, response, len(prompt))
        self.metrics.requests.labels(NO_BACKEND, "connect_error").inc()
        return no_backend_response()

    def _choose(self, method: str, candidates: list[Backend], prompt: str) -> Backend:
        if method != "POST":
            return candidates[0]
        choice = self.policy.choose(candidates, prompt)
        self.metrics.decisions.labels(choice.reason).inc()
        return choice.backend

    async def _send(self, backend: Backend, method: str, path: str, body: bytes, headers,
                    prompt_chars: int) -> aiohttp.ClientResponse | None:
        """The replica's response once its headers came; None if the request never started there."""
        backend.started(prompt_chars)
        try:
            return await self.client.request(method, backend.url + path, data=body, headers=_end_to_end(headers))
        except NEVER_STARTED as exc:
            backend.finished(prompt_chars)
            self.metrics.requests.labels(backend.url, "connect_error").inc()
            if isinstance(exc, UNREACHABLE):
                self.set_health(backend, False, f"{type(exc).__name__}: {exc}")
            return None
        except BaseException:
            backend.finished(prompt_chars)
            raise

    async def _done(self, backend: Backend, response: aiohttp.ClientResponse, prompt_chars: int,
                    outcome: str) -> None:
        if response.content.at_eof():
            response.release()  # the connection goes back to the pool
        else:
            response.close()  # unread bytes on it: it cannot carry another request
        backend.finished(prompt_chars)
        self.metrics.requests.labels(backend.url, outcome).inc()

    def _relay(self, backend: Backend, response: aiohttp.ClientResponse, prompt_chars: int) -> "RelayResponse":
        relay = Relay(response, lambda outcome: self._done(backend, response, prompt_chars, outcome))
        return RelayResponse(relay, status_code=response.status, headers=_end_to_end(response.headers))


class Relay:
    """A replica's response body handed on chunk by chunk, closed once whichever way it ends."""

    def __init__(self, response: aiohttp.ClientResponse, on_close):
        self.response = response
        self.outcome = "ok" if response.status < 400 else "http_error"
        self.on_close = on_close
        self.closed = False

    async def chunks(self):
        try:
            async for chunk in self.response.content.iter_any():
                yield chunk
        except aiohttp.ClientError:
            self.outcome = "stream_error"
            raise  # the client must see a broken stream, not a short one that looks complete
        finally:
            await self.close()

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await self.on_close(self.outcome)


class RelayResponse(StreamingResponse):
    """Closes the relay even when the client left before its body began (the generator never ran, so
    its own `finally` never would): the replica's connection and the in-flight count are released."""

    def __init__(self, relay: Relay, **kwargs):
        super().__init__(relay.chunks(), **kwargs)
        self.relay = relay

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.close()
