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

import goodserve
from goodserve.router.backend import Backend
from goodserve.router.config import RouterConfig
from goodserve.router.health import HealthChecker
from goodserve.router.metrics import RouterMetrics
from goodserve.router.policies import make_policy
from goodserve.router.prefix_tree import PrefixTree
from goodserve.router.proxy import Router

logger = logging.getLogger("goodserve.router")

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses")


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

    app = FastAPI(title="goodserve router", version=goodserve.__version__, lifespan=lifespan)
    app.state.router = router
    app.state.health = health

    async def relay(request: Request) -> Response:
        return await router.forward(request.method, request.url.path, await request.body(), request.headers)

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
