"""A batch's input lines, from JSONL to OpenAI's output lines, run through the online endpoints' handlers.

Each line ({custom_id, method, url, body}) is parsed into the endpoint's own request model and
answered by the same handler as the online endpoint, in process (serving_chat.py, ...), at
BATCH_PRIORITY: the engine serves every online request first and preempts batch lines first. A
line that cannot run (bad JSON, another url, a body of the wrong shape, a repeated custom_id) is
an error record naming its line number; a line the handler refuses is a record with its status
and OpenAI error body. Both the server's batch jobs (batch_runner.py) and `goodserve batch run`
(commands/batch.py) run lines through `run_lines`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from goodserve.errors import GoodserveError, QueueFullError
from goodserve.server.errors import describe_validation_error, error_body
from goodserve.server.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from goodserve.server.serving import ServingContext
from goodserve.server.serving_chat import create_chat_completion
from goodserve.server.serving_completions import create_completion
from goodserve.server.serving_embeddings import create_embedding

logger = logging.getLogger("goodserve.server")

# Lower is served first (SamplingParams.priority); online requests default to 0.
BATCH_PRIORITY = 1 << 30
# The endpoints a line may call: its request model and the online handler that answers it.
ENDPOINTS: dict[str, tuple[type[BaseModel], Callable]] = {
    "/v1/chat/completions": (ChatCompletionRequest, create_chat_completion),
    "/v1/completions": (CompletionRequest, create_completion),
    "/v1/embeddings": (EmbeddingRequest, create_embedding),
}
# No fault of the line: the engine is stopping (draining, dead); the job resumes on the next start.
_STOP_STATUS = 503


class BatchStopped(Exception):
    """The engine cannot take lines now (draining or dead): the job stops and resumes on the next start."""


@dataclass
class BatchLine:
    number: int  # 1-based line number in the input file
    custom_id: str | None
    url: str | None = None
    request: BaseModel | None = None  # the body as the endpoint's request model
    error: str | None = None  # why the line cannot run

    def error_record(self, code: str = "invalid_request", message: str | None = None) -> dict:
        """OpenAI's output line for a line that got no response."""
        return {"id": _record_id(), "custom_id": self.custom_id, "response": None,
                "error": {"code": code, "message": message or self.error, "line": self.number}}


@dataclass
class LineResult:
    line: BatchLine
    ok: bool  # answered with status 200
    record: dict  # the output line: {id, custom_id, response: {status_code, request_id, body}, error}


def _record_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def parse_lines(data: bytes, endpoints: Iterable[str]) -> list[BatchLine]:
    """Every non-blank line of a JSONL file, the malformed ones with their error; endpoints: the urls
    a line may name."""
    endpoints = set(endpoints)
    lines, seen = [], {}
    for number, raw in enumerate(data.split(b"\n"), 1):
        if raw.strip():
            line = _parse_line(number, raw, endpoints)
            if line.error is None and line.custom_id in seen:
                line.error = f"custom_id '{line.custom_id}' repeats line {seen[line.custom_id]}'s"
            seen.setdefault(line.custom_id, number)
            lines.append(line)
    return lines


def _parse_line(number: int, raw: bytes, endpoints: set[str]) -> BatchLine:
    try:
        item = json.loads(raw)
    except ValueError as exc:  # bad JSON or bad UTF-8
        return BatchLine(number, None, error=f"line {number} is not valid JSON: {exc}")
    except RecursionError:
        return BatchLine(number, None, error=f"line {number} nests its JSON deeper than this server reads")
    if not isinstance(item, dict):
        return BatchLine(number, None, error=f"line {number} is not a JSON object")
    custom_id, url, body = item.get("custom_id"), item.get("url"), item.get("body")
    line = BatchLine(number, custom_id if isinstance(custom_id, str) else None, url)
    if not isinstance(custom_id, str) or not custom_id:
        line.error = "custom_id must be a non-empty string"
    elif item.get("method") != "POST":
        line.error = "method must be POST"
    elif url not in endpoints:
        line.error = f"url must be {' or '.join(sorted(endpoints))}, got {url!r}"
    elif not isinstance(body, dict):
        line.error = "body must be a JSON object"
    elif body.get("stream"):
        line.error = "stream is not supported in a batch"
    else:
        line.request, line.error = _request(url, body)
    return line


def _request(url: str, body: dict) -> tuple[BaseModel | None, str | None]:
    model = ENDPOINTS[url][0]
    try:
        return model.model_validate(body), None
    except (ValidationError, GoodserveError) as exc:  # GoodserveError: a lone surrogate in the text
        if isinstance(exc, GoodserveError):
            return None, f"invalid body: {exc}"
        _, message = describe_validation_error(RequestValidationError(exc.errors()))
        return None, f"invalid body: {message}"


async def run_line(ctx: ServingContext, line: BatchLine) -> LineResult:
    """Answer one valid line as its endpoint would, at the lowest priority.

    Raises QueueFullError (wait and retry) and BatchStopped (the engine stops): neither is the line's
    answer."""
    handler = ENDPOINTS[line.url][1]
    request = line.request.model_copy(update={"priority": BATCH_PRIORITY})
    try:
        body = (await handler(ctx, request, None)).model_dump(mode="json")
        status = 200
    except QueueFullError:
        raise
    except GoodserveError as exc:
        if exc.http_status == _STOP_STATUS:
            raise BatchStopped(str(exc)) from exc
        status, body = exc.http_status, error_body(str(exc), exc.error_type, exc.http_status,
                                                   getattr(exc, "param", None))
    except Exception as exc:  # a bug: this line fails, the job goes on
        logger.exception("batch line %d (%s) failed", line.number, line.custom_id)
        status, body = 500, error_body(f"internal error: {type(exc).__name__}", "internal_error", 500)
    response = {"status_code": status, "request_id": body.get("id") or _record_id(), "body": body}
    record = {"id": _record_id(), "custom_id": line.custom_id, "response": response, "error": None}
    return LineResult(line, status == 200, record)


async def run_lines(ctx: ServingContext, lines: Iterable[BatchLine], max_concurrency: int,
                    record: Callable[[LineResult], Awaitable[None]],
                    stopping: Callable[[], bool] = lambda: False) -> None:
    """Answer the lines, at most max_concurrency at once, handing each result to record as it
    finishes; malformed lines are recorded as errors without running. Stops taking lines once
    stopping() is true; raises BatchStopped when the engine stops."""
    pending = iter(lines)

    async def worker() -> None:
        for line in pending:  # shared by the workers: each takes the next line
            if stopping():
                return
            if line.error is not None:
                await record(LineResult(line, False, line.error_record()))
            else:
                await record(await _run_retrying(ctx, line))

    workers = [asyncio.create_task(worker()) for _ in range(max_concurrency)]
    try:
        await asyncio.gather(*workers)
    finally:
        for task in workers:
            task.cancel()  # one failed (BatchStopped) or we were cancelled: the lines in flight abort
        await asyncio.gather(*workers, return_exceptions=True)


async def _run_retrying(ctx: ServingContext, line: BatchLine) -> LineResult:
    while True:
        try:
            return await run_line(ctx, line)
        except QueueFullError as exc:  # the waiting queue is full: the line waits its turn
            await asyncio.sleep(getattr(exc, "retry_after_s", 1))
