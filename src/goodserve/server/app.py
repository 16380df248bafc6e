"""The HTTP service: FastAPI routes over an AsyncEngine, and the uvicorn server that drains on SIGTERM."""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from goodserve.engine.frontend.admission import Admission
from goodserve.engine.setup.kv_groups import kv_groups
from goodserve.errors import InvalidRequestError, ModelLoadError
from goodserve.model.spec import SamplingDefaults
from goodserve.sampling_params import SamplingParams
from goodserve.server.auth import ApiKeyMiddleware, BodySizeLimitMiddleware
from goodserve.server.batch_routes import batch_router
from goodserve.server.batch_runner import BatchRunner
from goodserve.server.batch_store import BatchStore, DataDirInUseError, default_data_dir
from goodserve.server.connections import connection_capacity, guarded_protocol
from goodserve.server.errors import DrainingError, install_error_handlers
from goodserve.server.limits import check_within_context
from goodserve.server.metrics import ServerMetrics, Slo
from goodserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponsesRequest,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from goodserve.server.recording import RequestRecorder
from goodserve.server.serving import ServingContext
from goodserve.server.serving_chat import create_chat_completion
from goodserve.server.serving_completions import create_completion
from goodserve.server.serving_embeddings import create_embedding
from goodserve.server.serving_responses import create_response
from goodserve.version import __version__

logger = logging.getLogger("goodserve.server")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless the operator opens it up
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # default: the --model value
    max_waiting: int = 1024
    max_body_bytes: int = 4 << 20
    request_timeout_s: float | None = None
    drain_timeout_s: float = 30.0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    gpu_hourly_cost: float | None = None  # $ per GPU-hour: /metrics then reports the cost per hour
    # Under the slo policy: refuse the costliest requests first as the queue builds (engine/frontend/admission.py)
    slo_shed_costly: bool = False
    log_level: str = "info"
    max_unsent_outputs: int = 512
    stream_interval: int = 1
    header_timeout_s: float = 15.0
    max_connections: int | None = None  # default: what the open-file limit leaves (connection_capacity)
    backlog: int = 4096
    keep_alive_s: int = 30
    pooling: str = "last"  # /v1/embeddings: the last token's final hidden state (as vLLM for decoders) or the mean
    allow_unknown_fields: bool = False
    data_dir: str | None = None  # the Batch API's files and jobs (default: default_data_dir())
    batch_max_concurrency: int = 64
    batch_max_file_bytes: int = 100 << 20
    # The engine in a process of its own (engine/frontend/engine_process.py); None: so, unless --disaggregate
    engine_process: bool | None = None
    # auto: a request's unset temperature / top_p / top_k / min_p / repetition_penalty take the model's
    # generation_config.json values (vLLM's default); none: OpenAI's defaults
    generation_config: str = "auto"
    # Each accepted prompt as a JSON line with its arrival time (server/recording.py), for goodserve tune
    record_requests: str | None = None
    record_prompts: str = "hash"  # hash: a SHA-256 of the prompt's token ids; keep: its text

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


_FORM_OVERHEAD_BYTES = 64 << 10  # an upload's multipart framing and purpose field, beyond the file
_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 408, 413, 422, 429, 503)}


def startup_message(engine, config: ServerConfig, model_name: str) -> str:
    stats = engine.stats()
    block_size = engine.config.block_size
    # A hybrid model's block holds one of its layer groups (engine/setup/kv_groups.py): its tokens are those
    # every layer could keep (its local layers keep only their window, so the pool holds more).
    groups = kv_groups(engine.spec, engine.config).num_groups
    return (
        f"serving {model_name} ({engine.config.model}) dtype={str(engine.dtype).removeprefix('torch.')} "
        f"device={engine.device} kv_pool={stats.num_kv_blocks} blocks x {block_size}"
        f"{f' in {groups} layer groups' if groups > 1 else ''} = {stats.num_kv_blocks * block_size // groups} tokens "
        f"max_model_len={engine.max_model_len} at {config.url}"
    )


def sampling_defaults(engine, config: ServerConfig) -> SamplingDefaults:
    """The model's recommended sampling under --generation-config auto, checked now: a value the sampler
    refuses would otherwise fail every request that leaves it unset."""
    if config.generation_config == "none":
        return SamplingDefaults()
    defaults = engine.spec.sampling_defaults
    try:
        SamplingParams(**defaults.as_dict())
    except InvalidRequestError as e:
        raise ModelLoadError(f"the model's generation_config.json: {e} (start with --generation-config none to "
                             "ignore it)") from None
    if defaults.as_dict():
        logger.info("a request's unset sampling knobs take the model's generation_config.json values: %s "
                    "(--generation-config none: OpenAI's)",
                    ", ".join(f"{name}={value:g}" for name, value in defaults.as_dict().items()))
    return defaults


def build_app(engine, config: ServerConfig) -> FastAPI:
    model_name = config.served_model_name or engine.config.model
    slo = Slo(config.slo_ttft_ms, config.slo_tpot_ms)
    metrics = ServerMetrics(engine, model_name, slo, config.gpu_hourly_cost)
    ctx = ServingContext(engine, model_name, Admission(config.max_waiting, shed_costly=config.slo_shed_costly),
                         metrics, config.request_timeout_s,
                         config.max_unsent_outputs, config.stream_interval, config.pooling,
                         config.allow_unknown_fields, slo, sampling_defaults(engine, config),
                         RequestRecorder(config.record_requests, config.record_prompts == "keep", engine.tokenizer)
                         if config.record_requests else None)
    created = int(time.time())
    store = _open_store(Path(config.data_dir) if config.data_dir else default_data_dir())
    runner = None if isinstance(store, DataDirInUseError) else BatchRunner(
        store, ctx.for_batch(Admission(config.max_waiting)), metrics, config.batch_max_concurrency)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        logger.info(startup_message(engine, config, model_name))
        if runner is not None:
            await runner.resume()
        yield
        logger.info("draining in-flight requests (up to %.0fs)", config.drain_timeout_s)
        if runner is not None:  # batch lines in flight run again on the next start
            await runner.close()
            store.close()
        await engine.shutdown(config.drain_timeout_s)
        ctx.close()

    app = FastAPI(title="goodserve", version=__version__, lifespan=lifespan)
    app.state.draining = False
    app.state.ctx = ctx
    install_error_handlers(app, on_error=metrics.observe_rejected)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=config.max_body_bytes,
                       path_limits={"/v1/files": config.batch_max_file_bytes + _FORM_OVERHEAD_BYTES})
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)

    def ensure_accepting() -> None:
        if app.state.draining:
            raise DrainingError("the server is shutting down; send the request to another replica")

    @app.post("/v1/completions", response_model=None, responses={200: {"model": CompletionResponse}, **_ERRORS})
    async def completions(body: CompletionRequest, request: Request):
        ensure_accepting()
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions", response_model=None,
              responses={200: {"model": ChatCompletionResponse}, **_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        ensure_accepting()
        return await create_chat_completion(ctx, body, request)

    @app.post("/v1/embeddings", responses=_ERRORS)
    async def embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
        ensure_accepting()
        return await create_embedding(ctx, body, request)

    @app.post("/v1/responses", response_model=None, responses=_ERRORS)
    async def responses(body: ResponsesRequest, request: Request):
        ensure_accepting()
        return await create_response(ctx, body, request)

    if runner is None:
        app.include_router(_unavailable_router(store))
    else:
        app.include_router(batch_router(store, runner, config.batch_max_file_bytes, config.allow_unknown_fields,
                                        ensure_accepting))

    card = ModelCard(id=model_name, created=created, max_model_len=engine.max_model_len)

    @app.get("/v1/models", responses=_ERRORS)
    async def models() -> ModelList:
        return ModelList(data=[card])

    @app.get("/v1/models/{model_id:path}", responses=_ERRORS)
    async def model(model_id: str) -> ModelCard:
        ctx.check_model(model_id)
        return card

    @app.get("/version")
    async def server_version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.post("/tokenize", responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        ctx.check_request(body)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give exactly one of 'prompt' or 'messages'")
        if body.messages is not None:
            ids = await ctx.chat_prompt_ids(body.messages, body)
        else:
            ids = await ctx.encoder.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        check_within_context("prompt" if body.messages is None else "messages", len(ids), engine.max_model_len)
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids)

    @app.post("/detokenize", responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_request(body)
        check_within_context("tokens", len(body.tokens), engine.max_model_len)
        vocab_size = ctx.tokenizer.vocab_size
        if any(t >= vocab_size for t in body.tokens):
            raise InvalidRequestError(f"token ids must be in [0, {vocab_size})")
        return DetokenizeResponse(prompt=await ctx.encoder.in_pool(ctx.tokenizer.decode, body.tokens))

    @app.get("/health")
    async def health() -> Response:
        if engine.dead is not None:
            return JSONResponse({"status": "engine dead", "error": str(engine.dead)}, status_code=503)
        if app.state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _open_store(data_dir: Path) -> BatchStore | DataDirInUseError:
    try:
        store = BatchStore(data_dir)
    except DataDirInUseError as exc:  # this server still serves everything but the Batch API
        logger.warning("Batch API off: %s", exc)
        return exc
    logger.info("Batch API data in %s", data_dir)
    return store


def _unavailable_router(error: DataDirInUseError) -> APIRouter:
    router = APIRouter()

    @router.api_route("/v1/{kind:files|batches}{rest:path}", methods=["GET", "POST", "DELETE"],
                      include_in_schema=False)
    async def unavailable(kind: str, rest: str):
        raise error

    return router


class _DrainingServer(uvicorn.Server):
    """uvicorn stops accepting on SIGTERM and waits for open requests; /health says so meanwhile."""

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self.goodserve_app = app

    def handle_exit(self, sig, frame) -> None:
        self.goodserve_app.state.draining = True
        super().handle_exit(sig, frame)


def run_server(engine, config: ServerConfig) -> None:
    """Serve until SIGTERM/SIGINT, then let in-flight requests finish (up to drain_timeout_s)."""
    build_server(engine, config).run()


def build_server(engine, config: ServerConfig) -> uvicorn.Server:
    """The HTTP server over build_app's app, its connection guards on, not yet started. Run from the
    main thread it drains on SIGTERM/SIGINT; from another (tests) it stops once should_exit is set."""
    app = build_app(engine, config)
    max_connections = config.max_connections or connection_capacity()
    protocol = guarded_protocol(config.header_timeout_s, max_connections, retry_after_s=1,
                                on_refused=app.state.ctx.metrics.observe_rejected)
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level,
        timeout_graceful_shutdown=int(config.drain_timeout_s), access_log=False,
        http=protocol, backlog=config.backlog, timeout_keep_alive=config.keep_alive_s,
    )
    logger.info("accepting up to %d connections (--max-connections)", max_connections)
    return _DrainingServer(uv_config, app)
