"""What the OpenAI endpoints share: model check, tokenization, validation, jobs, SSE framing."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from functools import cached_property

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from goodserve.engine.frontend.admission import BEST_EFFORT_PRIORITY, Admission
from goodserve.errors import GoodserveError, InvalidRequestError, ModelLoadError, QueueFullError
from goodserve.model.spec import SamplingDefaults
from goodserve.sampling_params import SamplingParams
from goodserve.server.contract import check_fields
from goodserve.server.errors import error_body
from goodserve.server.generation import GenerationJob, cancel_on_disconnect
from goodserve.server.grammar_compiles import GrammarCompiles
from goodserve.server.metrics import ServerMetrics, Slo
from goodserve.server.protocol import ChatMessage, ChatTemplateFields
from goodserve.server.recording import RequestRecorder
from goodserve.server.tokenization import PromptEncoder
from goodserve.server.tool_calls import conversation

logger = logging.getLogger("goodserve.server")


@dataclass
class ServingContext:
    engine: object  # AsyncEngine
    model_name: str
    admission: Admission
    metrics: ServerMetrics
    request_timeout_s: float | None = None  # server-wide deadline; a request may ask for less
    max_unsent_outputs: int = 512  # a stream this far behind its engine request is aborted
    stream_interval: int = 1  # --stream-interval: tokens a streamed chunk holds, after the first
    pooling: str = "last"  # how /v1/embeddings pools the final hidden states (--pooling)
    allow_unknown_fields: bool = False  # --allow-unknown-fields: ignore them with a warning, not a 400
    slo: Slo | None = None  # --slo-ttft-ms / --slo-tpot-ms: the targets of requests that set none
    # --generation-config auto: the model's recommended sampling, for the knobs a request leaves unset
    sampling_defaults: SamplingDefaults = SamplingDefaults()
    recorder: RequestRecorder | None = None  # --record-requests: each accepted prompt, with its arrival


    @property
    def tokenizer(self):
        if self.engine.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer; send prompts as token ids")
        return self.engine.tokenizer

    @cached_property
    def encoder(self) -> PromptEncoder:
        return PromptEncoder(self.tokenizer, self.engine.max_model_len)

    @cached_property
    def grammars(self) -> GrammarCompiles:
        # (the engine's compiler is built on the first grammar, on the compile thread: ~1 s)
        return GrammarCompiles(lambda spec: self.engine.inputs.grammars.compile(spec))

    def close(self) -> None:
        for pool in ("encoder", "grammars"):  # each built on the first request that needed it
            if pool in self.__dict__:
                self.__dict__[pool].close()
        if self.recorder is not None:
            self.recorder.close()

    def for_batch(self, admission: Admission) -> ServingContext:
        """The same serving path for batch lines (server/batch_lines.py): their own waiting-queue count,
        so online requests never get a 429 for places batch lines hold, and no server-wide deadline,
        since they wait in the capacity online traffic leaves, with no latency targets. One tokenizer
        pool serves both."""
        view = replace(self, admission=admission, request_timeout_s=None, slo=None, recorder=None)  # not traffic
        if self.engine.tokenizer is not None:
            view.encoder = self.encoder
        view.grammars = self.grammars
        return view

    def check_request(self, req: BaseModel) -> None:
        """The contract (contract.py), then the model name."""
        check_fields(req, type(req).unsupported, self.allow_unknown_fields)
        self.check_model(getattr(req, "model", None))

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelLoadError(f"model '{model}' is not served here; this server serves '{self.model_name}'")

    async def chat_prompt_ids(self, messages: list[ChatMessage], template: ChatTemplateFields | None = None,
                              tools: list[dict] = ()) -> list[int]:
        if not messages:
            raise InvalidRequestError("messages must contain at least one message")
        template = template or ChatTemplateFields()
        self.tokenizer.check_template_kwargs(template.chat_template_kwargs or {})
        rendered, tool_kwargs = conversation(messages, list(tools), self.tokenizer.chat_template)
        return await self.encoder.encode_chat(rendered, template.render_kwargs() | tool_kwargs)

    async def completion_prompt_ids(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise InvalidRequestError("prompt must not be empty")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        texts = [p for p in prompt if isinstance(p, str)]
        for text in texts:  # refuse any prompt that cannot fit before tokenizing the others
            self.encoder.check_fits(len(text.encode()))
        return [await self.encoder.encode(p) if isinstance(p, str) else list(p) for p in prompt]

    async def new_job(self, kind: str, prompts: list[list[int]], params: SamplingParams,
                      request_timeout_s: float | None, best_effort: bool = False,
                      ends_early=None, stream: bool = False) -> GenerationJob:
        """Validate every prompt (a request that can never fit is a 400 now), then take queue places:
        a 429 if the queue is full or, under the slo policy, makes its TTFT target impossible (unless
        best_effort: then it waits at a low priority). ends_early: GenerationJob's. Only a stream can
        fall behind its client (a whole answer is taken on the event loop as it comes), so only a
        stream is aborted for outputs its client has not read."""
        max_n = self.engine.config.max_n_per_request
        if params.n > max_n:
            raise InvalidRequestError(f"n={params.n} is more than this server allows (--max-n {max_n})")
        if params.structured_outputs is not None:  # validating then finds it compiled
            await self.grammars.compile(params.structured_outputs)
        self._validate(prompts, params)
        if self.recorder is not None:
            self.recorder.record(prompts, params)
        timeouts = [t for t in (self.request_timeout_s, request_timeout_s) if t is not None]
        deadline = time.monotonic() + min(timeouts) if timeouts else None
        job = GenerationJob(
            engine=self.engine, request_id=f"{kind}-{uuid.uuid4().hex}", prompts=prompts, params=params,
            admission=self.admission, metrics=self.metrics, deadline=deadline,
            max_unsent_outputs=self.max_unsent_outputs if stream else None, stream_interval=self.stream_interval, ends_early=ends_early,
        )
        self._apply_slo(params, prompts, best_effort)
        job.admit()
        return job

    def _apply_slo(self, params: SamplingParams, prompts: list[list[int]], best_effort: bool) -> None:
        """The server's targets where the request sets none; the TTFT admission check (slo policy), which
        counts the tokens each sample may generate (without max_tokens: the rest of the context)."""
        if self.slo is None:
            return
        if params.slo_ttft_ms is None:
            params.slo_ttft_ms = self.slo.ttft_ms
        if params.slo_tpot_ms is None:
            params.slo_tpot_ms = self.slo.tpot_ms
        if params.slo_ttft_ms is None or self.engine.config.scheduler_policy != "slo":
            return
        try:
            output_tokens = params.n * sum(params.max_tokens or self.engine.max_model_len - len(ids) for ids in prompts)
            self.admission.check_ttft(self.engine.forecast(), sum(map(len, prompts)), params.slo_ttft_ms,
                                      output_tokens)
        except QueueFullError:
            if not best_effort:
                raise
            params.priority = max(params.priority, BEST_EFFORT_PRIORITY)

    def _validate(self, prompts: list[list[int]], params: SamplingParams) -> None:
        for ids in prompts:
            self.engine.validate_request(ids, params)

    async def run_to_end(self, job: GenerationJob, request: Request | None):
        """request None: an in-process caller (a batch line), which cancels by cancelling its task."""
        try:
            return await (job.run() if request is None else cancel_on_disconnect(request, job.run()))
        finally:
            job.release()


async def stream_chunks(ctx: ServingContext, req, job: GenerationJob, chunk_type,
                        make_choice) -> AsyncIterator[BaseModel]:
    """The SSE payloads of one streamed request: a chunk per choice delta, then usage if asked
    (stream_options.include_usage), in every chunk too with continuous_usage_stats (the tokens
    generated so far, as vLLM counts them).

    chunk_type is the response model (completion or chat chunk); make_choice(delta) its choice."""
    created = int(time.time())
    async for delta in job.deltas():
        choice = make_choice(delta)
        if choice is not None:  # None: nothing certain to send yet (a tool call being parsed)
            yield chunk_type(id=job.request_id, created=created, model=ctx.model_name, choices=[choice],
                             usage=job.usage() if req.usage_in_every_chunk else None)
    if req.include_usage_in_stream:
        yield chunk_type(id=job.request_id, created=created, model=ctx.model_name, choices=[], usage=job.usage())


def sse(payload: BaseModel | dict | str) -> str:
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json()
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


async def _sse_events(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """Frame chunks as server-sent events; a failure mid-stream becomes an error event, then [DONE]."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except GoodserveError as exc:
        yield sse(error_body(str(exc), exc.error_type, exc.http_status))
    except Exception as exc:
        logger.exception("stream failed")
        yield sse(error_body(f"internal error: {type(exc).__name__}", "internal_error", 500))
    yield sse("[DONE]")


class JobStreamingResponse(StreamingResponse):
    """An SSE response that gives back its job's queue places even if the stream never starts."""

    def __init__(self, chunks: AsyncIterator[BaseModel], job: GenerationJob, frame=None):
        """frame(chunks): the SSE text; default: a data line per chunk, then [DONE]."""
        super().__init__((frame or _sse_events)(chunks), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.release()
