"""Request guards that run before any route: the API key and the request body size limit.

Both are plain ASGI middleware so that an unauthenticated or oversized request is refused before
its body is read or parsed.
"""

from __future__ import annotations

import secrets

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from goodserve.server.errors import error_body

# Probes and scrapers must work without the key; everything else needs it.
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs"})


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not secrets.compare_digest(given, self.expected):
            body = error_body("missing or invalid API key: send 'Authorization: Bearer <key>'",
                              "authentication_error", 401)
            response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, path_limits: dict[str, int] | None = None):
        """path_limits: routes with their own limit (file uploads)."""
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.path_limits = path_limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.path_limits.get(scope["path"], self.max_body_bytes)
        message = f"request body exceeds the {limit}-byte limit"
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            response = JSONResponse(error_body(message, "request_too_large", 413), status_code=413)
            return await response(scope, receive, send)
        received = 0

        async def counting_receive() -> Message:
            # Chunked uploads declare no length: count as they arrive.
            nonlocal received
            chunk = await receive()
            received += len(chunk.get("body", b""))
            if received > limit:
                raise HTTPException(413, message)
            return chunk

        await self.app(scope, counting_receive, send)
