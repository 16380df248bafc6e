"""The router's HTTP front: the OpenAI routes relayed to replicas, its own /health and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect

from goodserve.router.backend import Backend
from goodserve.router.config import RouterConfig
from goodserve.router.health import HealthChecker
from goodserve.router.metrics import RouterMetrics
from goodserve.router.policies import make_policy
from goodserve.router.prefix_tree import PrefixTree
from goodserve.router.proxy import CLIENT_GONE_STATUS, Router, error_response
from goodserve.version import __version__

logger = logging.getLogger("goodserve.router")

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses")


class BodyTooLarge(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused as soon as it is known to pass `limit`: from its Content-Length before
    a byte is read, else (chunked) while it streams in; never held whole past the limit."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


async def hang_up(request: Request) -> None:
    """Returns when the client hangs up; once its body is read, the only message left to receive."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_router(config: RouterConfig) -> Router:
    backends = [Backend(url.rstrip("/")) for url in config.backends]
    tree = PrefixTree(config.prefix_chunk_chars, config.prefix_tree_max_nodes)
    policy = make_policy(config.policy, tree, match_threshold=config.prefix_match_threshold,
                         balance_abs_threshold=config.balance_abs_threshold,
                         balance_rel_threshold=config.balance_rel_threshold)
    return Router(backends, policy, tree, RouterMetrics(backends), config.connect_timeout_s)


def build_app(config: RouterConfig) -> FastAPI:
    router = build_router(config)
    health = HealthChecker(router, config.health_interval_s, config.health_timeout_s, config.scrape_load)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await health.check_all()  # a replica down at start is out until it answers
        logger.info("routing (%s) to %s", config.policy,
                    ", ".join(f"{b.url} ({'up' if b.healthy else 'down'})" for b in router.backends))
        checks = asyncio.create_task(health.run())
        yield
        checks.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await checks
        await router.close()

    app = FastAPI(title="goodserve router", version=__version__, lifespan=lifespan)
    app.state.router = router
    app.state.health = health

    async def relay(request: Request) -> Response:
        try:
            body = await read_body(request, config.max_body_bytes)
        except BodyTooLarge:
            return error_response(f"request body exceeds the {config.max_body_bytes}-byte limit", "request_too_large",
                                  413)
        except ClientDisconnect:
            return Response(status_code=CLIENT_GONE_STATUS)
        hung_up = asyncio.ensure_future(hang_up(request))
        try:
            return await router.forward(request.method, request.url.path, body, request.headers, hung_up)
        finally:
            hung_up.cancel()

    for path in ROUTED_PATHS:
        app.add_api_route(path, relay, methods=["POST"])
    app.add_api_route("/v1/models", relay, methods=["GET"])

    @app.get("/health")
    async def router_health() -> Response:
        healthy = sum(b.healthy for b in router.backends)
        return JSONResponse({"status": "ok" if healthy else "no healthy replica", "healthy_backends": healthy},
                            status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def router_metrics() -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def run_router(config: RouterConfig) -> None:
    uvicorn.run(build_app(config), host=config.host, port=config.port, log_level=config.log_level,
                timeout_keep_alive=30)
