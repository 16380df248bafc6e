"""POST /v1/chat/completions: the chat template turns messages into one prompt with n choices."""

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
)
from goodserve.server.serving import JobStreamingResponse, ServingContext, stream_chunks


async def create_chat_completion(
    ctx: ServingContext, req: ChatCompletionRequest, request: Request
) -> Response | ChatCompletionResponse:
    ctx.check_request(req)
    params = req.sampling_params()
    prompt = await ctx.chat_prompt_ids(req.messages, req.add_generation_prompt)
    job = ctx.new_job("chatcmpl", [prompt], params, req.request_timeout_s)
    if req.stream:
        k = job.params.logprobs
        chunks = stream_chunks(ctx, req.include_usage_in_stream, job, ChatCompletionChunk,
                               lambda delta: _chunk_choice(ctx, k, delta))
        return JobStreamingResponse(chunks, job)
    (out,) = await ctx.run_to_end(job, request)
    choices = []
    for c in out.outputs:
        logprobs = None
        if params.logprobs is not None and c.logprobs is not None:
            logprobs = chat_logprobs(c.token_ids, c.logprobs, params.logprobs)
        choices.append(ChatChoice(
            index=c.index, message=AssistantMessage(content=c.text), logprobs=logprobs,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
        ))
    return ChatCompletionResponse(id=job.request_id, model=ctx.model_name, choices=choices, usage=job.usage())


def _chunk_choice(ctx: ServingContext, k: int | None, delta: ChoiceDelta) -> ChatStreamChoice:
    logprobs = None
    if k is not None and delta.logprobs is not None:
        logprobs = chat_logprobs(delta.token_ids, delta.logprobs, k)
    message = DeltaMessage(role="assistant" if delta.first else None, content=delta.text)
    return ChatStreamChoice(index=delta.index, delta=message, logprobs=logprobs,
                            finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)

