"""POST /v1/chat/completions: the chat template turns messages into one prompt with n choices.

With tools, an output becomes tool_calls (server/tool_calls.py, tool_parsers.py): parsed from the
text under tool_choice auto, or the whole (grammar-constrained) output under required / a named
function; finish_reason is then "tool_calls". Streaming sends a forced named call's arguments as
they come, parses auto text as it grows, and sends a required array's calls once it is complete.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from goodserve.server.generation import ChoiceDelta
from goodserve.server.logprobs import chat_logprobs
from goodserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from goodserve.server.serving import JobStreamingResponse, ServingContext, stream_chunks
from goodserve.server.tool_calls import forced_calls, output_calls, prompt_tools, repeated_call_check, tool_mode
from goodserve.server.tool_parsers import ToolCallStream, new_call_id


async def create_chat_completion(
    ctx: ServingContext, req: ChatCompletionRequest, request: Request | None
) -> Response | ChatCompletionResponse:
    ctx.check_request(req)
    params = req.sampling_params(ctx.sampling_defaults)
    mode = tool_mode(req)
    prompt = await ctx.chat_prompt_ids(req.messages, req, prompt_tools(req))
    job = await ctx.new_job("chatcmpl", [prompt], params, req.request_timeout_s, req.slo_best_effort,
                            ends_early=repeated_call_check(req), stream=bool(req.stream))
    if req.stream:
        k = job.params.logprobs
        streams: dict[int, _ChoiceStream] = {}

        def make_choice(delta: ChoiceDelta) -> ChatStreamChoice | None:
            stream = streams.setdefault(delta.index, _ChoiceStream(req, mode))
            return _chunk_choice(k, delta, stream)

        chunks = stream_chunks(ctx, req, job, ChatCompletionChunk, make_choice)
        return JobStreamingResponse(chunks, job)
    (out,) = await ctx.run_to_end(job, request)
    choices = []
    for c in out.outputs:
        logprobs = None
        if params.logprobs is not None and c.logprobs is not None:
            logprobs = chat_logprobs(c.token_ids, c.logprobs, params.logprobs)
        content, calls = output_calls(req, mode, c.text, c.finish_reason == "length")
        message = AssistantMessage(content=content, tool_calls=[
            ToolCall(id=new_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))
            for call in calls] or None)
        choices.append(ChatChoice(
            index=c.index, message=message, logprobs=logprobs,
            finish_reason=_finish_reason(c.finish_reason, bool(calls)), stop_reason=c.stop_reason,
        ))
    return ChatCompletionResponse(id=job.request_id, model=ctx.model_name, choices=choices, usage=job.usage())


def _finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


class _ChoiceStream:
    """One choice's streamed text turned into content and tool-call deltas."""

    def __init__(self, req: ChatCompletionRequest, mode: str):
        self.req, self.mode = req, mode
        self.parser = ToolCallStream() if mode == "auto" else None
        self.text, self.call_id, self.has_calls = "", None, False

    def feed(self, text: str, final: bool, truncated: bool = False) -> tuple[str | None, list[dict]]:
        if self.parser is not None:
            content, calls = self.parser.feed(text, final)
            self.has_calls = self.parser.found_calls
            return content, calls
        if self.mode == "named":  # the whole output is the arguments: stream them as they come
            self.has_calls = True
            first, self.call_id = self.call_id is None, self.call_id or new_call_id()
            if not text and not first:
                return None, []
            call = {"index": 0, "function": {"arguments": text}}
            if first:
                call.update(id=self.call_id, type="function")
                call["function"]["name"] = self.req.tool_choice.function.name
            return None, [call]
        if self.mode == "required":  # an array of calls: sent whole once it parses
            self.text += text
            if not final:
                return None, []
            calls = forced_calls(self.req, self.text, truncated)
            if not calls:
                return (None if truncated else self.text), []
            self.has_calls = True
            return None, [{"index": i, "id": new_call_id(), "type": "function",
                           "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)]
        return text, []


def _chunk_choice(k: int | None, delta: ChoiceDelta, stream: _ChoiceStream) -> ChatStreamChoice | None:
    final = delta.finish_reason is not None
    content, calls = stream.feed(delta.text, final, delta.finish_reason == "length")
    logprobs = None
    if k is not None and delta.logprobs is not None:
        logprobs = chat_logprobs(delta.token_ids, delta.logprobs, k)
    if stream.mode != "none" and not content and not calls and not final and not delta.first and logprobs is None:
        return None
    message = DeltaMessage(role="assistant" if delta.first else None,
                           content=content if content or not calls else None,
                           tool_calls=[DeltaToolCall.model_validate(c) for c in calls] or None)
    return ChatStreamChoice(index=delta.index, delta=message, logprobs=logprobs,
                            finish_reason=_finish_reason(delta.finish_reason, stream.has_calls),
                            stop_reason=delta.stop_reason)
