"""OpenAI-style error bodies: every failure a client can see is {"error": {message, type, code}}."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from goodserve.errors import GoodserveError
from goodserve.server.contract import UNSUPPORTED_TYPE
from goodserve.server.limits import LIMIT_ERROR_TYPES

logger = logging.getLogger("goodserve.server")

# Starlette/FastAPI raise these for routing and protocol problems; give them OpenAI names.
_HTTP_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}


class AuthenticationError(GoodserveError):
    http_status = 401
    error_type = "authentication_error"


class RequestTooLargeError(GoodserveError):
    http_status = 413
    error_type = "request_too_large"


class DeadlineExceededError(GoodserveError):
    """The request's deadline passed before it finished; it was aborted to free its capacity."""

    http_status = 408
    error_type = "timeout_error"


class ClientDisconnectedError(GoodserveError):
    """Nobody reads this response; nginx's 499 names the case."""

    http_status = 499
    error_type = "client_closed_request"


class ClientNotReadingError(GoodserveError):
    """The response could not be sent as fast as it was made: the request was aborted."""

    http_status = 408
    error_type = "timeout_error"


class DrainingError(GoodserveError):
    """SIGTERM received: in-flight requests finish, new ones go elsewhere."""

    http_status = 503
    error_type = "service_unavailable"


def error_body(message: str, error_type: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


_REFUSED_ERROR_TYPES = LIMIT_ERROR_TYPES | {UNSUPPORTED_TYPE, "extra_forbidden"}


def _is_union_member(loc_part: object) -> bool:
    """pydantic names which member of a union failed ('list[constrained-str]'); no field has such a name."""
    return isinstance(loc_part, str) and ("[" in loc_part or "-" in loc_part)


def describe_validation_error(exc: RequestValidationError) -> tuple[int, str]:
    """Malformed JSON is a 400; well-formed JSON of the wrong shape is a 422, as FastAPI has it."""
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return 400, "request body is not valid JSON"
    # Past a bound, not text, an object of a type goodserve does not run or a key a strict object does
    # not know: a bad value (400). Under a union the other members' type errors come too; this one is what
    # the client must fix.
    refused = [e for e in errors if e.get("type") in _REFUSED_ERROR_TYPES]
    status, errors = (400, refused) if refused else (422, errors)
    parts = []
    for e in errors[:5]:
        # loc is ("body", field, ...); the client only knows the field path.
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body" and not _is_union_member(x))
        message = "not supported by this server (see docs/serving.md)" if e.get("type") == "extra_forbidden" \
            else e.get("msg", "invalid")
        parts.append(f"{loc}: {message}" if loc else message)
    return status, "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None]) -> None:
    """on_error(status) hears of every refused request (for the rejection counter)."""

    @app.exception_handler(GoodserveError)
    async def _goodserve_error(request: Request, exc: GoodserveError) -> JSONResponse:
        on_error(exc.http_status)
        overloaded = exc.http_status in (429, 503)
        if overloaded:  # the client is told to come back; the operator should see it happen
            logger.info("refused %s %s with %d: %s", request.method, request.url.path, exc.http_status, exc)
        headers = {"Retry-After": str(getattr(exc, "retry_after_s", 1))} if overloaded else None
        body = error_body(str(exc), exc.error_type, exc.http_status, getattr(exc, "param", None))
        return JSONResponse(body, status_code=exc.http_status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        status, message = describe_validation_error(exc)
        on_error(status)
        return JSONResponse(error_body(message, "invalid_request_error", status), status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = _HTTP_ERROR_TYPES.get(exc.status_code, "invalid_request_error")
        return JSONResponse(
            error_body(str(exc.detail), error_type, exc.status_code),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not a client error: log the traceback here, keep it out of the response.
        logger.exception("unhandled error serving %s %s", request.method, request.url.path)
        body = error_body(f"internal error: {type(exc).__name__}", "internal_error", 500)
        return JSONResponse(body, status_code=500)
