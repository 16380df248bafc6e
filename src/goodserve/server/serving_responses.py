"""POST /v1/responses: the request becomes a chat turn (ResponsesRequest.chat_request), runs as one,
tools included (server/tool_calls.py), and comes back as a Response object (a message item, then a
function_call item per call), or streamed as Responses API events.

Nothing is stored (store=true is refused), so previous_response_id and the other stateful fields
are refused too (contract.py); a function's output comes back in the next request's input.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from goodserve.errors import GoodserveError
from goodserve.outputs import RequestOutput
from goodserve.server.generation import GenerationJob
from goodserve.server.protocol import ResponsesRequest, ResponseTextFormat
from goodserve.server.serving import JobStreamingResponse, ServingContext
from goodserve.server.tool_calls import output_calls, prompt_tools, repeated_call_check, tool_mode
from goodserve.server.tool_parsers import ToolCallStream, ToolCallText, new_call_id

logger = logging.getLogger("goodserve.server")


async def create_response(ctx: ServingContext, req: ResponsesRequest, request: Request) -> Response | dict:
    ctx.check_request(req)
    chat = req.chat_request()
    prompt = await ctx.chat_prompt_ids(chat.messages, tools=prompt_tools(chat))
    job = await ctx.new_job("resp", [prompt], chat.sampling_params(ctx.sampling_defaults), None,
                            ends_early=repeated_call_check(chat), stream=bool(req.stream))
    shape = _Shape(ctx.model_name, req, job, tool_mode(chat))
    if req.stream:
        return JobStreamingResponse(_events(job, shape, chat), job, frame=lambda events: events)
    (out,) = await ctx.run_to_end(job, request)
    content, calls = output_calls(chat, shape.mode, out.outputs[0].text, out.outputs[0].finish_reason == "length")
    return shape.response(out, content or "", shape.calls(calls))


@dataclass(frozen=True)
class _Call:
    item_id: str
    call_id: str
    call: ToolCallText

    def item(self, status: str = "completed") -> dict:
        return {"type": "function_call", "id": self.item_id, "call_id": self.call_id, "name": self.call.name,
                "arguments": self.call.arguments if status == "completed" else "", "status": status}


class _Shape:
    """The Response object and its output items, as OpenAI's Responses API spells them."""

    def __init__(self, model: str, req: ResponsesRequest, job: GenerationJob, mode: str) -> None:
        self.model, self.req, self.job, self.mode = model, req, job, mode
        self.id = "resp_" + job.request_id.removeprefix("resp-")
        self.item_id = "msg_" + uuid.uuid4().hex
        self.text_at = {"item_id": self.item_id, "output_index": 0, "content_index": 0}  # the message's text
        self.created_at = int(time.time())

    @staticmethod
    def calls(calls: list[ToolCallText]) -> list[_Call]:
        return [_Call("fc_" + uuid.uuid4().hex, new_call_id(), call) for call in calls]

    def item(self, text: str, status: str) -> dict:
        """The message item; status completed, incomplete (cut by max_output_tokens) or in_progress."""
        done = status != "in_progress"
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def output(self, text: str, calls: list[_Call], status: str) -> list[dict]:
        """A message item unless the output is calls alone, then the calls."""
        return ([self.item(text, status)] if text or not calls else []) + [call.item() for call in calls]

    def response(self, out: RequestOutput | None, text: str = "", calls: list[_Call] = ()) -> dict:
        done = out is not None
        incomplete = done and out.outputs[0].finish_reason == "length"
        usage = None
        if done:
            u = self.job.usage()
            usage = {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
                     "total_tokens": u.total_tokens,
                     "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
                     "output_tokens_details": {"reasoning_tokens": 0}}
        choice = self.req.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": ("incomplete" if incomplete else "completed") if done else "in_progress",
            "output": self.output(text, list(calls), "incomplete" if incomplete else "completed") if done else [],
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None, "instructions": self.req.instructions, "max_output_tokens": self.req.max_output_tokens,
            "temperature": self.req.temperature, "top_p": self.req.top_p,
            "parallel_tool_calls": self.req.parallel_tool_calls,
            "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str)
            else choice or ("auto" if self.req.tools else "none"),
            "tools": [tool.model_dump(exclude_none=True) for tool in self.req.tools or []],
            "text": {"format": (self.req.text.format if self.req.text else ResponseTextFormat()).model_dump(
                by_alias=True, exclude_none=True)}, "store": False, "usage": usage,
        }


async def _events(job: GenerationJob, shape: _Shape, chat) -> AsyncIterator[str]:
    """The stream's events as SSE with event names and sequence numbers; a failure becomes an error event."""
    sequence = iter(range(1 << 62))

    def event(kind: str, fields: dict) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(sequence), **fields})}\n\n"

    try:
        async for kind, fields in _event_fields(job, shape, chat):
            yield event(kind, fields)
    except GoodserveError as exc:
        yield event("error", {"code": exc.error_type, "message": str(exc), "param": None})
    except Exception as exc:
        logger.exception("stream failed")
        yield event("error", {"code": "internal_error", "message": f"internal error: {type(exc).__name__}",
                              "param": None})


async def _event_fields(job: GenerationJob, shape: _Shape, chat) -> AsyncIterator[tuple[str, dict]]:
    """response.created ... the message's text deltas ... each function call ... response.completed.
    The message item opens with its first text; a call is sent whole once the output is complete (its
    arguments in one delta)."""
    yield "response.created", {"response": shape.response(None)}
    yield "response.in_progress", {"response": shape.response(None)}
    parser = ToolCallStream() if shape.mode == "auto" else None
    text = ""  # the message's text sent so far
    async for delta in job.deltas():
        piece = _message_text(parser, shape.mode, delta.text, delta.finish_reason is not None)
        if piece:
            for opening in _message_opening(shape) if not text else ():
                yield opening
            text += piece
            yield "response.output_text.delta", {**shape.text_at, "delta": piece, "logprobs": []}
    out = job.final[0]
    content, found = output_calls(chat, shape.mode, out.outputs[0].text, out.outputs[0].finish_reason == "length")
    calls = shape.calls(found)
    opened = bool(text)
    if shape.mode in ("required", "named") and content:
        text = content  # forced JSON that did not parse (cut short) is the message, sent whole
    if text or not calls:
        status = "incomplete" if out.outputs[0].finish_reason == "length" else "completed"
        for closing in _message_closing(shape, text, opened, status):
            yield closing
    for index, call in enumerate(calls, start=1 if text or not calls else 0):
        ids = {"item_id": call.item_id, "output_index": index}
        yield "response.output_item.added", {"output_index": index, "item": call.item("in_progress")}
        yield "response.function_call_arguments.delta", {**ids, "delta": call.call.arguments}
        yield "response.function_call_arguments.done", {**ids, "arguments": call.call.arguments}
        yield "response.output_item.done", {"output_index": index, "item": call.item()}
    final = shape.response(out, text, calls)
    yield "response.incomplete" if final["status"] == "incomplete" else "response.completed", {"response": final}


def _message_opening(shape: _Shape) -> list[tuple[str, dict]]:
    return [("response.output_item.added", {"output_index": 0, "item": shape.item("", "in_progress")}),
            ("response.content_part.added", {**shape.text_at, "part": _text_part("")})]


def _message_closing(shape: _Shape, text: str, opened: bool, status: str) -> list[tuple[str, dict]]:
    """The message item's last events; its opening and its text in one delta where none went yet."""
    unsent = [] if opened else [*_message_opening(shape), *(
        [("response.output_text.delta", {**shape.text_at, "delta": text, "logprobs": []})] if text else [])]
    return [*unsent, ("response.output_text.done", {**shape.text_at, "text": text, "logprobs": []}),
            ("response.content_part.done", {**shape.text_at, "part": _text_part(text)}),
            ("response.output_item.done", {"output_index": 0, "item": shape.item(text, status)})]


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def _message_text(parser: ToolCallStream | None, mode: str, delta: str, final: bool) -> str:
    """What of a delta is the message's text now: all of it without tools, what the parser is sure is
    not a call under auto, none under a forced call (its JSON is the call)."""
    if mode == "none":
        return delta
    if parser is None:
        return ""
    return parser.feed(delta, final)[0]
