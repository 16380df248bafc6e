"""POST /v1/embeddings: each input's final hidden states (after the last norm), pooled as the server's
--pooling says (last token or mean) and L2-normalized, computed in the engine's step loop like any
request (SamplingParams.pooling: the request finishes once its prompt is computed)."""

from __future__ import annotations

import base64

import numpy as np
from starlette.requests import Request

from goodserve.errors import InvalidRequestError
from goodserve.sampling_params import SamplingParams
from goodserve.server.protocol import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from goodserve.server.serving import ServingContext


async def create_embedding(ctx: ServingContext, req: EmbeddingRequest,
                           request: Request | None) -> EmbeddingResponse:
    ctx.check_request(req)
    hidden_size = ctx.engine.spec.hidden_size
    if req.dimensions is not None and req.dimensions != hidden_size:
        raise InvalidRequestError(f"dimensions must be this model's hidden size ({hidden_size}) or absent: "
                                  "embeddings are not truncated")
    prompts = await ctx.completion_prompt_ids(req.input)
    job = await ctx.new_job("embd", prompts, SamplingParams(max_tokens=0, pooling=ctx.pooling, priority=req.priority), None)
    outputs = await ctx.run_to_end(job, request)
    data = [Embedding(index=i, embedding=_encoded(out.embedding, req.encoding_format)) for i, out in enumerate(outputs)]
    tokens = sum(len(ids) for ids in prompts)
    return EmbeddingResponse(data=data, model=ctx.model_name,
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as OpenAI's clients decode it
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode()
    return embedding
