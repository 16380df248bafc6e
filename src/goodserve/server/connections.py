"""Connection guards uvicorn lacks: a deadline for request headers, and a connection cap that answers.

uvicorn times out idle keep-alive connections only after a first response: a client that opens
a socket and sends half its headers holds it (and a file descriptor) forever. And a burst of
connections past the process's open-file limit fails in accept(), which the client sees as a
dropped or reset connection. Here each request must finish its headers within header_timeout_s
of its connection opening (or, on a kept-alive connection, of its first bytes), and connections
past max_connections get a JSON 503 with Retry-After, then are closed. And a connection's send
buffer is bounded, so a stream whose client stops reading is noticed (_bound_send_buffer).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import socket
from collections.abc import Callable

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from goodserve.server.errors import error_body

logger = logging.getLogger("goodserve.server")

# A connection's kernel send buffer (Linux keeps twice this): ~5 MB/s on a 100 ms round trip, far more
# than a stream of tokens needs; a client that stops reading is noticed within it (_bound_send_buffer).
SEND_BUFFER_BYTES = 256 << 10
FD_RESERVE = 64  # descriptors kept free beyond those open at start (logs, the tokenizer pool, ...)


def raise_open_file_limit() -> int:
    """Lift the soft open-file limit to the hard one (a default 1024 is less than a busy server's
    sockets); return the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-file limit from %d: %s", soft, exc)
    return soft


def connection_capacity() -> int:
    """Connections the process can hold: its open-file limit (raised) less what is open now (the
    model's files, torch's, ...) and a reserve. Past it accept() fails and clients see resets."""
    limit = raise_open_file_limit()
    open_now = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 256
    return max(16, limit - open_now - FD_RESERVE)


def _bound_send_buffer(transport) -> None:
    """Fix the socket's send buffer at SEND_BUFFER_BYTES. Left to the kernel it grows to 4 MB, and a
    client that stops reading a stream has it absorb thousands of small events before the response
    is ever told to wait: generation for nobody goes on. Bounded, the response waits within a few
    hundred KB, its outputs pile up and --max-unsent-outputs aborts it."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)


class OverloadedApp:
    """Answers one request with 503 + Retry-After and closes its connection."""

    def __init__(self, max_connections: int, retry_after_s: int, on_refused: Callable[[int], None]):
        body = error_body(f"the server has {max_connections} open connections, its limit; retry in "
                          f"{retry_after_s}s", "service_unavailable", 503)
        self.body = json.dumps(body).encode()
        self.headers = [(b"content-type", b"application/json"), (b"content-length", str(len(self.body)).encode()),
                        (b"retry-after", str(retry_after_s).encode()), (b"connection", b"close")]
        self.on_refused = on_refused
        self.max_connections = max_connections

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        # Read the (small) body first: closing a socket with unread input sends a reset, which
        # can destroy the response before the client reads it.
        message = await receive()
        while message.get("more_body"):
            message = await receive()
        self.on_refused(503)
        logger.info("refused %s %s: over %d open connections", scope["method"], scope["path"], self.max_connections)
        await send({"type": "http.response.start", "status": 503, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


def guarded_protocol(header_timeout_s: float, max_connections: int, retry_after_s: int,
                     on_refused: Callable[[int], None]) -> type:
    """uvicorn's HTTP protocol class (httptools or h11, whichever it picks) with both guards."""
    overloaded = OverloadedApp(max_connections, retry_after_s, on_refused)

    class GuardedHTTPProtocol(AutoHTTPProtocol):
        header_deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            _bound_send_buffer(transport)
            if len(self.connections) > max_connections:
                self.app = overloaded
            self._arm_header_deadline()

        def data_received(self, data: bytes) -> None:
            # The first bytes of a next request on a kept-alive connection start its deadline.
            if self.header_deadline is None and self._waiting_for_headers():
                self._arm_header_deadline()
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._disarm_header_deadline()  # an idle kept-alive connection is uvicorn's timeout_keep_alive

        def connection_lost(self, exc) -> None:
            self._disarm_header_deadline()
            super().connection_lost(exc)

        def _waiting_for_headers(self) -> bool:
            # A cycle exists from the moment a request's headers are complete until its response is.
            return self.cycle is None or self.cycle.response_complete

        def _arm_header_deadline(self) -> None:
            self._disarm_header_deadline()
            self.header_deadline = self.loop.call_later(header_timeout_s, self._header_deadline_passed)

        def _disarm_header_deadline(self) -> None:
            if self.header_deadline is not None:
                self.header_deadline.cancel()
                self.header_deadline = None

        def _header_deadline_passed(self) -> None:
            self.header_deadline = None
            if self._waiting_for_headers() and not self.transport.is_closing():
                logger.info("closing a connection from %s: no complete request headers within %gs",
                            self.client, header_timeout_s)
                self.transport.close()

    return GuardedHTTPProtocol
