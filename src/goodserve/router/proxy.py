"""A request through the router: pick a healthy replica, send, relay the response byte for byte.

A request is sent again to another replica only when it never started on the first: the connection
was refused or reset before any response byte came, the replica went silent before answering (its
health check timed out: a frozen process), or it answered 503 (it is draining or at its connection
cap) while another is left to try. Once a response has begun it is relayed as it arrives (SSE event
by event) and never retried: a break then ends a stream with an error event and [DONE], any other
body as a broken one, never as a short answer that looks complete. A client that hangs up closes its
request to the replica, which aborts it.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.responses import Response

from goodserve.router.backend import Backend
from goodserve.router.metrics import NO_BACKEND, RouterMetrics
from goodserve.router.prefix_tree import PrefixTree
from goodserve.router.prompt_text import UnreadableBody, prompt_text

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


def error_body(message: str, error_type: str, status: int) -> dict:
    return {"error": {"message": message, "type": error_type, "param": None, "code": status}}


def error_response(message: str, error_type: str, status: int, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, error_type, status), status_code=status, headers=headers)


def no_backend_response() -> JSONResponse:
    return error_response("no healthy replica could take the request", "service_unavailable", 503,
                          headers={"Retry-After": "1"})


def silent_backend_response() -> JSONResponse:
    return error_response("the replica stopped answering before it began the response, and no other could "
                          "take the request", "timeout", 504)


class ReplicaSilent(Exception):
    """The replica stopped answering (its health check failed) before its response began."""


class ClientGone(Exception):
    """The client hung up before the replica's response began."""


# What a client that hung up is answered: nobody reads it (nginx's "client closed request").
CLIENT_GONE_STATUS = 499


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

    def set_health(self, backend: Backend, healthy: bool, why: str = "", silent: bool = False) -> None:
        """silent: it answered nothing at all, so the requests waiting for its headers stop waiting and
        the responses it had begun are cut; a replica that answers 503 (draining) still finishes the
        requests it has."""
        if silent:
            backend.silent.set()
            for response in list(backend.relaying):  # a stream that will never go on: ended (Relay)
                response.close()
        if backend.healthy == healthy:
            return
        backend.healthy = healthy
        if healthy:
            backend.silent = asyncio.Event()
            logger.info("replica %s is healthy again: back in rotation", backend.url)
        else:
            logger.warning("replica %s taken out: %s", backend.url, why)
            backend.scraped_requests = None
            self.tree.forget(backend.url)

    async def forward(self, method: str, path: str, body: bytes, headers,
                      hung_up: asyncio.Future | None = None) -> Response:
        """Routes POSTs by the policy; a GET (/v1/models) goes to the first healthy replica. hung_up:
        done when the client hangs up, which closes the request to the replica."""
        try:
            prompt = prompt_text(body) if method == "POST" else ""
        except UnreadableBody as exc:
            return error_response(str(exc), "invalid_request_error", 400)
        hung_up = hung_up or asyncio.get_running_loop().create_future()
        tried: set[str] = set()
        went_silent = False
        while candidates := [b for b in self.backends if b.healthy and b.url not in tried]:
            if tried:
                self.metrics.retries.inc()
            backend = self._choose(method, candidates, prompt)
            tried.add(backend.url)
            try:
                response = await self._send(backend, method, path, body, headers, len(prompt), hung_up)
            except ClientGone:
                return Response(status_code=CLIENT_GONE_STATUS)
            if isinstance(response, str):  # it never started there
                went_silent |= response == "timeout"
                continue
            if response.status == 503 and len(candidates) > 1:  # draining: it did not run the request
                await self._done(backend, response, len(prompt), "http_error")
                continue
            return self._relay(backend, response, path, len(prompt))
        if went_silent:
            return silent_backend_response()
        self.metrics.requests.labels(NO_BACKEND, "connect_error").inc()
        return no_backend_response()

    def _choose(self, method: str, candidates: list[Backend], prompt: str) -> Backend:
        if method != "POST":
            return candidates[0]
        choice = self.policy.choose(candidates, prompt)
        self.metrics.decisions.labels(choice.reason).inc()
        return choice.backend

    async def _send(self, backend: Backend, method: str, path: str, body: bytes, headers, prompt_chars: int,
                    hung_up: asyncio.Future) -> aiohttp.ClientResponse | str:
        """The replica's response once its headers came, else the outcome that says why the request
        never started there ("connect_error", or "timeout": the replica went silent)."""
        backend.started(prompt_chars)
        try:
            sending = self.client.request(method, backend.url + path, data=body, headers=_end_to_end(headers))
            return await self._headers(backend, sending, hung_up)
        except (NEVER_STARTED, ReplicaSilent) as exc:
            backend.finished(prompt_chars)
            outcome = "timeout" if isinstance(exc, ReplicaSilent) else "connect_error"
            self.metrics.requests.labels(backend.url, outcome).inc()
            if isinstance(exc, UNREACHABLE):
                self.set_health(backend, False, f"{type(exc).__name__}: {exc}")
            return outcome
        except BaseException:
            backend.finished(prompt_chars)
            raise

    @staticmethod
    async def _headers(backend: Backend, sending, hung_up: asyncio.Future) -> aiohttp.ClientResponse:
        """Awaits the response's headers while the replica answers its health checks and the client is
        there. No fixed deadline: a non-streamed answer's headers come only once it is whole, minutes
        for a long one; a replica's silence is what says it will never come. Either way out closes
        the request's connection, and the replica aborts the request."""
        sending = asyncio.ensure_future(sending)
        silent = asyncio.ensure_future(backend.silent.wait())
        try:
            await asyncio.wait((sending, silent, hung_up), return_when=asyncio.FIRST_COMPLETED)
        finally:
            silent.cancel()
            if not sending.done():
                sending.cancel()
                await asyncio.wait((sending,))
        if not sending.cancelled():
            return sending.result()
        if hung_up.done():
            raise ClientGone
        raise ReplicaSilent

    async def _done(self, backend: Backend, response: aiohttp.ClientResponse, prompt_chars: int,
                    outcome: str) -> None:
        if response.content.at_eof():
            response.release()  # the connection goes back to the pool
        else:
            response.close()  # unread bytes on it: it cannot carry another request
        backend.relaying.discard(response)
        backend.finished(prompt_chars)
        self.metrics.requests.labels(backend.url, outcome).inc()

    def _relay(self, backend: Backend, response: aiohttp.ClientResponse, path: str,
               prompt_chars: int) -> "RelayResponse":
        relay = Relay(response, path, lambda outcome: self._done(backend, response, prompt_chars, outcome))
        backend.relaying.add(response)
        return RelayResponse(relay, status_code=response.status, headers=_end_to_end(response.headers))


def stream_break_events(exc: Exception, path: str) -> bytes:
    """How a stream whose replica failed mid-answer ends, as a replica ends one that failed in its own
    engine: an error event the OpenAI clients raise, then [DONE]; the Responses API's own error event."""
    message = f"the replica serving this stream failed mid-answer ({type(exc).__name__}): the answer is incomplete"
    if path == "/v1/responses":
        event = {"type": "error", "code": "replica_error", "message": message, "param": None}
        return f"event: error\ndata: {json.dumps(event)}\n\n".encode()
    return f"data: {json.dumps(error_body(message, 'replica_error', 502))}\n\ndata: [DONE]\n\n".encode()


class Relay:
    """A replica's response body handed on chunk by chunk, closed once whichever way it ends."""

    def __init__(self, response: aiohttp.ClientResponse, path: str, on_close):
        self.response = response
        self.path = path
        self.outcome = "ok" if response.status < 400 else "http_error"
        self.sse = response.status == 200 and response.content_type == "text/event-stream"
        self.on_close = on_close
        self.closed = False

    async def chunks(self):
        try:
            async for chunk in self._whole_events() if self.sse else self.response.content.iter_any():
                yield chunk
        except aiohttp.ClientError as exc:
            self.outcome = "stream_error"
            if not self.sse:
                raise  # the client must see a broken body, not a short one that looks complete
            yield stream_break_events(exc, self.path)
        finally:
            await self.close()

    async def _whole_events(self):
        """The SSE body as it arrives, cut after its last whole event: the part of an event the replica
        had sent when it died is never relayed, so the error event that ends the stream parses."""
        partial = b""
        async for chunk in self.response.content.iter_any():
            chunk = partial + chunk
            end = chunk.rfind(b"\n\n") + 2  # 1: no whole event yet
            if end == 1:
                partial = chunk
                continue
            partial = chunk[end:]
            yield chunk[:end]
        if partial:  # the replica closed the stream cleanly without a last blank line
            yield partial

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
