"""POST /v1/responses, the text case: the request becomes a chat turn (ResponsesRequest.chat_request),
runs as one, and comes back as a Response object, or streamed as Responses API events.

Nothing is stored (store=true is refused), so previous_response_id and the other stateful fields
are refused too (contract.py).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from goodserve.errors import GoodserveError
from goodserve.outputs import RequestOutput
from goodserve.server.generation import GenerationJob
from goodserve.server.protocol import ResponsesRequest
from goodserve.server.serving import JobStreamingResponse, ServingContext

logger = logging.getLogger("goodserve.server")


async def create_response(ctx: ServingContext, req: ResponsesRequest, request: Request) -> Response | dict:
    ctx.check_request(req)
    chat = req.chat_request()
    prompt = await ctx.chat_prompt_ids(chat.messages)
    job = await ctx.new_job("resp", [prompt], chat.sampling_params(ctx.sampling_defaults), None)
    shape = _Shape(ctx.model_name, req, job)
    if req.stream:
        return JobStreamingResponse(_events(job, shape), job, frame=lambda events: events)
    (out,) = await ctx.run_to_end(job, request)
    return shape.response(out)


class _Shape:
    """The Response object and its message item, as OpenAI's Responses API spells them."""

    def __init__(self, model: str, req: ResponsesRequest, job: GenerationJob) -> None:
        self.model, self.req, self.job = model, req, job
        self.id = "resp_" + job.request_id.removeprefix("resp-")
        self.item_id = "msg_" + uuid.uuid4().hex
        self.created_at = int(time.time())

    def item(self, text: str, status: str) -> dict:
        done = status == "completed"
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def response(self, out: RequestOutput | None) -> dict:
        done = out is not None
        completion = out.outputs[0] if done else None
        incomplete = done and completion.finish_reason == "length"
        usage = None
        if done:
            u = self.job.usage()
            usage = {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
                     "total_tokens": u.total_tokens,
                     "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
                     "output_tokens_details": {"reasoning_tokens": 0}}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": ("incomplete" if incomplete else "completed") if done else "in_progress",
            "output": [self.item(completion.text, "completed")] if done else [],
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None, "instructions": self.req.instructions, "max_output_tokens": self.req.max_output_tokens,
            "temperature": self.req.temperature, "top_p": self.req.top_p, "parallel_tool_calls": False,
            "tool_choice": "none", "tools": [], "text": {"format": {"type": "text"}}, "store": False,
            "usage": usage,
        }


async def _events(job: GenerationJob, shape: _Shape) -> AsyncIterator[str]:
    """response.created ... response.output_text.delta ... response.completed, as SSE with event names."""
    sequence = iter(range(1 << 62))

    def event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(sequence), **fields})}\n\n"

    at = {"item_id": shape.item_id, "output_index": 0, "content_index": 0}
    try:
        yield event("response.created", response=shape.response(None))
        yield event("response.in_progress", response=shape.response(None))
        yield event("response.output_item.added", output_index=0, item=shape.item("", "in_progress"))
        yield event("response.content_part.added", **at, part={"type": "output_text", "text": "", "annotations": []})
        async for delta in job.deltas():
            if delta.text:
                yield event("response.output_text.delta", **at, delta=delta.text, logprobs=[])
        out = job.final[0]
        text = out.outputs[0].text
        yield event("response.output_text.done", **at, text=text, logprobs=[])
        yield event("response.content_part.done", **at, part={"type": "output_text", "text": text, "annotations": []})
        yield event("response.output_item.done", output_index=0, item=shape.item(text, "completed"))
        final = shape.response(out)
        yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)
    except GoodserveError as exc:
        yield event("error", code=exc.error_type, message=str(exc), param=None)
    except Exception as exc:
        logger.exception("stream failed")
        yield event("error", code="internal_error", message=f"internal error: {type(exc).__name__}", param=None)
