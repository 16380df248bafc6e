"""POST /v1/completions: one engine request per prompt, choices numbered prompt * n + i."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from goodserve.server.generation import ChoiceDelta
from goodserve.server.logprobs import completion_logprobs
from goodserve.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from goodserve.server.serving import JobStreamingResponse, ServingContext, stream_chunks


async def create_completion(ctx: ServingContext, req: CompletionRequest, request: Request) -> Response | CompletionResponse:
    ctx.check_model(req.model)
    params = req.sampling_params()
    prompts = await ctx.completion_prompt_ids(req.prompt)
    job = ctx.new_job("cmpl", prompts, params, req.request_timeout_s)
    if req.stream:
        k = job.params.logprobs
        chunks = stream_chunks(ctx, req.include_usage_in_stream, job, CompletionResponse,
                               lambda delta: _chunk_choice(ctx, k, delta))
        return JobStreamingResponse(chunks, job)
    outputs = await ctx.run_to_end(job, request)
    choices = []
    for prompt_index, out in enumerate(outputs):
        for c in out.outputs:
            logprobs = None
            if params.logprobs is not None and c.logprobs is not None:
                logprobs = completion_logprobs(c.token_ids, c.logprobs, params.logprobs, 0)
            choices.append(CompletionChoice(
                index=prompt_index * params.n + c.index, text=c.text, logprobs=logprobs,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            ))
    return CompletionResponse(id=job.request_id, model=ctx.model_name, choices=choices, usage=job.usage())


def _chunk_choice(ctx: ServingContext, k: int | None, delta: ChoiceDelta) -> CompletionChoice:
    logprobs = None
    if k is not None and delta.logprobs is not None:
        logprobs = completion_logprobs(delta.token_ids, delta.logprobs, k, delta.text_offset)
    return CompletionChoice(index=delta.index, text=delta.text, logprobs=logprobs,
                            finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)

