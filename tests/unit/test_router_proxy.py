"""The router's HTTP front against stand-in replicas (aiohttp servers on loopback): relay, retry,
health, metrics."""

from __future__ import annotations

import asyncio
import functools
import json
import time

import aiohttp
import httpx2
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from goodserve.router.app import build_app
from goodserve.router.config import RouterConfig
from goodserve.router.health import queued_requests
from goodserve.server.process import free_port


class FakeReplicas:
    """Two replicas on loopback, `a` and `b` (their URLs). Each answers /health, /metrics and the
    OpenAI routes; `reset` ones drop a request's connection before answering, `broken` ones stream a
    chunk and then drop it, `draining` ones answer 503; `stop(url)` takes one off its port (connections
    are refused), and `held` keeps a stream's second chunk back until it is set."""

    def __init__(self):
        self.a, self.b = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
        self.reset: set[str] = set()
        self.broken: set[str] = set()
        self.unhealthy: set[str] = set()
        self.draining: set[str] = set()
        self.held: asyncio.Event | None = None
        self.served: dict[str, list[str]] = {self.a: [], self.b: []}
        self.runners: dict[str, web.AppRunner] = {}
        self.routers: list = []  # routers in front of them, whose clients close with them

    async def start(self) -> FakeReplicas:
        for url in (self.a, self.b):
            app = web.Application()
            app.router.add_route("*", "/{path:.*}", functools.partial(self.answer, url))
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", int(url.rsplit(":", 1)[1])).start()
            self.runners[url] = runner
        return self

    async def stop(self, url: str) -> None:
        await self.runners.pop(url).cleanup()

    async def close(self) -> None:
        for url in list(self.runners):
            await self.stop(url)
        for router in self.routers:
            await router.close()

    async def answer(self, url: str, request: web.Request) -> web.StreamResponse:
        path = request.path
        if url in self.reset and path.startswith("/v1/"):
            request.transport.close()  # no response byte: the request never started here
            return web.Response()
        if path == "/health":
            return web.json_response({}, status=503 if url in self.unhealthy else 200)
        if path == "/metrics":
            return web.Response(text='goodserve:num_requests_waiting{model_name="m"} 3.0\n')
        if path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "m"}]})
        if url in self.draining:
            return web.json_response({"error": {"message": "draining"}}, status=503)
        self.served[url].append((await request.json())["prompt"])
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(f"data: {json.dumps({'chunk': 0, 'replica': url})}\n\n".encode())
        if url in self.broken:
            request.transport.abort()  # the stream breaks after it began
            return response
        if self.held is not None:
            await self.held.wait()
        for i in (1, 2):
            await response.write(f"data: {json.dumps({'chunk': i, 'replica': url})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def router_client(fakes: FakeReplicas, policy: str = "round-robin") -> tuple[httpx2.AsyncClient, object]:
    config = RouterConfig(backends=(fakes.a, fakes.b), policy=policy, scrape_load=True)
    app = build_app(config)
    fakes.routers.append(app.state.router)
    client = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://router")
    return client, app


def metrics(text: str) -> dict[str, float]:
    """{'name{label=value,...}': value}; a sample without labels is its name alone."""
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            found[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return found


async def complete(client: httpx2.AsyncClient, prompt: str) -> httpx2.Response:
    return await client.post("/v1/completions", json={"model": "m", "prompt": prompt, "stream": True})


def run(scenario):
    """scenario(fakes) with the replicas up, and everything closed after."""
    async def main():
        fakes = await FakeReplicas().start()
        try:
            await scenario(fakes)
        finally:
            await fakes.close()
    asyncio.run(main())


def test_relays_the_stream_whole_and_counts_it_per_replica():
    async def scenario(fakes):
        client, _ = router_client(fakes)
        first, second = await complete(client, "one"), await complete(client, "two")
        assert first.headers["content-type"].startswith("text/event-stream")
        assert first.text.count("data: ") == 4 and first.text.endswith("data: [DONE]\n\n")
        assert f'"replica": "{fakes.b}"' in second.text
        assert fakes.served == {fakes.a: ["one"], fakes.b: ["two"]}  # round-robin
        assert (await client.get("/v1/models")).json()["data"][0]["id"] == "m"
        found = metrics((await client.get("/metrics")).text)
        assert found[f"goodserve:router_requests_total{{backend={fakes.a},outcome=ok}}"] == 2  # "one", /v1/models
        assert found[f"goodserve:router_in_flight_requests{{backend={fakes.b}}}"] == 0
        assert found["goodserve:router_decisions_total{decision=round_robin}"] == 2
        # Its own CPU time (Prometheus' process metrics), the measure of whether it is the limit.
        assert 0 < found["process_cpu_seconds_total"] <= time.process_time() + 1
    run(scenario)


def test_each_chunk_is_relayed_as_it_arrives():
    """The router hands on the replica's first SSE event while the replica still holds back the rest."""
    async def scenario(fakes):
        fakes.held = asyncio.Event()
        _, app = router_client(fakes)
        body = json.dumps({"prompt": "p", "stream": True}).encode()
        response = await asyncio.wait_for(app.state.router.forward("POST", "/v1/completions", body, {}), 5)
        chunks = response.body_iterator
        assert b'"chunk": 0' in await asyncio.wait_for(anext(chunks), 5)
        fakes.held.set()
        rest = b"".join([chunk async for chunk in chunks])
        assert rest.count(b"data: ") == 3 and rest.endswith(b"data: [DONE]\n\n")
        assert app.state.router.backends[0].in_flight == 0
    run(scenario)


def test_a_client_gone_before_the_body_began_releases_the_replica():
    async def scenario(fakes):
        _, app = router_client(fakes)
        body = json.dumps({"prompt": "p", "stream": True}).encode()
        response = await app.state.router.forward("POST", "/v1/completions", body, {})
        assert app.state.router.backends[0].in_flight == 1

        async def receive():
            await asyncio.sleep(60)

        async def send(message):
            raise OSError("the client closed the connection")

        scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "path": "/v1/completions"}
        with pytest.raises(Exception):
            await response(scope, receive, send)
        assert app.state.router.backends[0].in_flight == 0
    run(scenario)


def test_a_request_that_never_started_goes_to_the_other_replica_and_the_dead_one_is_taken_out():
    async def scenario(fakes):
        await fakes.stop(fakes.a)  # its port refuses connections
        client, _ = router_client(fakes)
        responses = [await complete(client, f"p{i}") for i in range(3)]
        assert all(r.status_code == 200 for r in responses)
        assert fakes.served == {fakes.a: [], fakes.b: ["p0", "p1", "p2"]}
        found = metrics((await client.get("/metrics")).text)
        assert found["goodserve:router_retries_total"] == 1  # afterwards A is out: no more tries there
        assert found[f"goodserve:router_requests_total{{backend={fakes.a},outcome=connect_error}}"] == 1
        assert found[f"goodserve:router_backend_healthy{{backend={fakes.a}}}"] == 0
        assert (await client.get("/health")).status_code == 200
    run(scenario)


def test_a_reset_before_the_response_is_retried_without_taking_the_replica_out():
    async def scenario(fakes):
        fakes.reset.add(fakes.a)
        client, app = router_client(fakes)
        assert (await complete(client, "p")).status_code == 200
        assert fakes.served == {fakes.a: [], fakes.b: ["p"]}
        assert app.state.router.backends[0].healthy  # the health check judges it
    run(scenario)


def test_a_draining_replica_s_503_is_retried_elsewhere():
    async def scenario(fakes):
        fakes.draining.add(fakes.a)
        client, _ = router_client(fakes)
        assert (await complete(client, "p")).status_code == 200
        assert fakes.served[fakes.b] == ["p"]
    run(scenario)


def test_a_stream_that_broke_after_it_began_is_never_retried():
    async def scenario(fakes):
        fakes.broken.add(fakes.a)
        client, _ = router_client(fakes)
        with pytest.raises(aiohttp.ClientPayloadError):  # the client sees the break, not a short stream
            await complete(client, "p")
        assert fakes.served == {fakes.a: ["p"], fakes.b: []}
        found = metrics((await client.get("/metrics")).text)
        assert found.get("goodserve:router_retries_total", 0) == 0
        assert found[f"goodserve:router_requests_total{{backend={fakes.a},outcome=stream_error}}"] == 1
        assert found[f"goodserve:router_in_flight_requests{{backend={fakes.a}}}"] == 0
    run(scenario)


def test_health_checks_take_a_replica_out_and_put_it_back():
    async def scenario(fakes):
        client, app = router_client(fakes)
        fakes.unhealthy.add(fakes.a)
        await app.state.health.check_all()
        assert [await complete(client, f"p{i}") for i in range(2)] and fakes.served[fakes.a] == []
        fakes.unhealthy.clear()
        await app.state.health.check_all()
        assert app.state.router.backends[0].scraped_requests == 3  # the replica's queue, from its /metrics
        await complete(client, "p2")
        await complete(client, "p3")
        assert len(fakes.served[fakes.a]) == 1
        for url in (fakes.a, fakes.b):  # both gone
            await fakes.stop(url)
        await app.state.health.check_all()
        assert (await client.get("/health")).status_code == 503
        response = await complete(client, "p4")
        assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
    run(scenario)


def test_queued_requests_reads_running_and_waiting_from_a_replica_s_metrics():
    text = ('goodserve:num_requests_running{model_name="m"} 4.0\n'
            'goodserve:num_requests_waiting{model_name="m"} 2.0\n'
            'goodserve:kv_cache_usage_perc{model_name="m"} 0.5\n')
    assert queued_requests(text) == 6
