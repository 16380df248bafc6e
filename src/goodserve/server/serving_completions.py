"""POST /v1/completions: one engine request per prompt, choices numbered prompt * n + i.

echo: each choice starts with its prompt's text and, with logprobs, the prompt tokens' logprobs
(the engine's prompt_logprobs; the first token's is None). Streaming sends them with each choice's
first chunk; max_tokens=0 scores the prompt alone.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from goodserve.outputs import RequestOutput
from goodserve.server.generation import ChoiceDelta, GenerationJob
from goodserve.server.logprobs import completion_logprobs, joined
from goodserve.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from goodserve.server.serving import JobStreamingResponse, ServingContext, stream_chunks


async def create_completion(ctx: ServingContext, req: CompletionRequest,
                            request: Request | None) -> Response | CompletionResponse:
    ctx.check_request(req)
    params = req.sampling_params(ctx.sampling_defaults)
    prompts = await ctx.completion_prompt_ids(req.prompt)
    job = await ctx.new_job("cmpl", prompts, params, req.request_timeout_s, req.slo_best_effort,
                            stream=bool(req.stream))
    echo = _Echo(ctx, req, prompts) if req.echo else None
    if req.stream:
        k = job.params.logprobs
        chunks = stream_chunks(ctx, req, job, CompletionResponse,
                               lambda delta: _chunk_choice(job, k, delta, echo))
        return JobStreamingResponse(chunks, job)
    outputs = await ctx.run_to_end(job, request)
    choices = []
    for prompt_index, out in enumerate(outputs):
        for c in out.outputs:
            text_offset, prefix, logprobs = 0, "", None
            if echo is not None:
                prefix, logprobs = echo.prefix(prompt_index, out)
                text_offset = len(prefix)
            if params.logprobs is not None and c.logprobs is not None:
                logprobs = joined(logprobs, completion_logprobs(c.token_ids, c.logprobs, params.logprobs, text_offset))
            choices.append(CompletionChoice(
                index=prompt_index * params.n + c.index, text=prefix + c.text, logprobs=logprobs,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            ))
    return CompletionResponse(id=job.request_id, model=ctx.model_name, choices=choices, usage=job.usage())


class _Echo:
    """The prompt text and prompt logprobs a choice starts with."""

    def __init__(self, ctx: ServingContext, req: CompletionRequest, prompts: list[list[int]]) -> None:
        raw = [req.prompt] if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else req.prompt
        self.tokenizer, self.k, self.prompts = ctx.tokenizer, req.logprobs, prompts
        self.texts = [p if isinstance(p, str) else ctx.tokenizer.decode(ids, skip_special_tokens=False)
                      for p, ids in zip(raw, prompts)]

    def prefix(self, prompt_index: int, out: RequestOutput) -> tuple[str, CompletionLogprobs | None]:
        if self.k is None:
            return self.texts[prompt_index], None
        ids = self.prompts[prompt_index]
        first = self.tokenizer.decode(ids[:1], skip_special_tokens=False)
        return self.texts[prompt_index], completion_logprobs(ids, out.prompt_logprobs, self.k, 0, first)


def _chunk_choice(job: GenerationJob, k: int | None, delta: ChoiceDelta, echo: _Echo | None) -> CompletionChoice:
    text_offset, prefix, logprobs = delta.text_offset, "", None
    if echo is not None:
        prompt_index = delta.index // job.params.n
        text_offset += len(echo.texts[prompt_index])
        if delta.first:
            prefix, logprobs = echo.prefix(prompt_index, job.final[prompt_index])
    if k is not None and delta.logprobs is not None:
        logprobs = joined(logprobs, completion_logprobs(delta.token_ids, delta.logprobs, k, text_offset))
    return CompletionChoice(index=delta.index, text=prefix + delta.text, logprobs=logprobs,
                            finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
