"""The router's HTTP front against fake replicas (httpx2.MockTransport): relay, retry, health, metrics."""

from __future__ import annotations

import asyncio
import json
import time

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from goodserve.router.app import build_app
from goodserve.router.config import RouterConfig
from goodserve.router.health import queued_requests

A, B = "http://a:8000", "http://b:8000"


async def _streamed(body: bytes):
    """A body as a real transport gives it (httpx reads a bytes body at once: nothing left to relay)."""
    yield body


class FakeReplicas:
    """Each replica answers /health, /metrics and the OpenAI routes; `down` ones refuse connections,
    `reset` ones drop a request's connection before answering, `broken` ones stream a chunk and then
    drop it."""

    def __init__(self):
        self.down: set[str] = set()
        self.reset: set[str] = set()
        self.broken: set[str] = set()
        self.unhealthy: set[str] = set()
        self.draining: set[str] = set()
        self.served: dict[str, list[str]] = {A: [], B: []}

    async def __call__(self, request: httpx2.Request) -> httpx2.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if url in self.down:
            raise httpx2.ConnectError("connection refused", request=request)
        path = request.url.path
        if url in self.reset and path.startswith("/v1/"):
            raise httpx2.RemoteProtocolError("server disconnected without sending a response", request=request)
        if path == "/health":
            return httpx2.Response(503 if url in self.unhealthy else 200, json={})
        if path == "/metrics":
            return httpx2.Response(200, text="goodserve:num_requests_waiting{model_name=\"m\"} 3.0\n")
        if path == "/v1/models":
            return httpx2.Response(200, content=_streamed(b'{"object": "list", "data": [{"id": "m"}]}'))
        if url in self.draining:
            return httpx2.Response(503, content=_streamed(b'{"error": {"message": "draining"}}'))
        self.served[url].append(json.loads(request.content)["prompt"])
        if url in self.broken:
            return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=self._break(request))
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=self._stream(url))

    async def _stream(self, url: str):
        for i in range(3):
            yield f"data: {json.dumps({'chunk': i, 'replica': url})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    async def _break(self, request: httpx2.Request):
        yield b"data: {\"chunk\": 0}\n\n"
        raise httpx2.ReadError("connection reset by peer", request=request)


def router_client(fakes: FakeReplicas, policy: str = "round-robin") -> tuple[httpx2.AsyncClient, object]:
    config = RouterConfig(backends=(A, B), policy=policy, scrape_load=True)
    app = build_app(config, transport=httpx2.MockTransport(fakes))
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


def run(coro):
    return asyncio.run(coro)


def test_relays_the_stream_whole_and_counts_it_per_replica():
    async def scenario():
        fakes = FakeReplicas()
        client, _ = router_client(fakes)
        first, second = await complete(client, "one"), await complete(client, "two")
        assert first.headers["content-type"].startswith("text/event-stream")
        assert first.text.count("data: ") == 4 and first.text.endswith("data: [DONE]\n\n")
        assert f'"replica": "{B}"' in second.text
        assert fakes.served == {A: ["one"], B: ["two"]}  # round-robin
        assert (await client.get("/v1/models")).json()["data"][0]["id"] == "m"
        found = metrics((await client.get("/metrics")).text)
        assert found[f"goodserve:router_requests_total{{backend={A},outcome=ok}}"] == 2  # "one" and /v1/models
        assert found[f"goodserve:router_in_flight_requests{{backend={B}}}"] == 0
        assert found["goodserve:router_decisions_total{decision=round_robin}"] == 2
        # Its own CPU time (Prometheus' process metrics), the measure of whether it is the limit.
        assert 0 < found["process_cpu_seconds_total"] <= time.process_time() + 1
    run(scenario())


def test_each_chunk_is_relayed_as_it_arrives():
    """The router hands on the replica's first SSE event while the replica still holds back the rest."""
    async def scenario():
        release = asyncio.Event()

        async def slow_stream():
            yield b"data: first\n\n"
            await release.wait()
            yield b"data: [DONE]\n\n"

        transport = httpx2.MockTransport(lambda request: httpx2.Response(200, content=slow_stream()))
        app = build_app(RouterConfig(backends=(A,)), transport=transport)
        body = json.dumps({"prompt": "p", "stream": True}).encode()
        response = await asyncio.wait_for(app.state.router.forward("POST", "/v1/completions", body, {}), 5)
        chunks = response.body_iterator
        assert await asyncio.wait_for(anext(chunks), 5) == b"data: first\n\n"
        release.set()
        assert [chunk async for chunk in chunks] == [b"data: [DONE]\n\n"]
        assert app.state.router.backends[0].in_flight == 0
    run(scenario())


def test_a_client_gone_before_the_body_began_releases_the_replica():
    async def scenario():
        fakes = FakeReplicas()
        app = build_app(RouterConfig(backends=(A,)), transport=httpx2.MockTransport(fakes))
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
    run(scenario())


def test_a_request_that_never_started_goes_to_the_other_replica_and_the_dead_one_is_taken_out():
    async def scenario():
        fakes = FakeReplicas()
        fakes.down.add(A)
        client, _ = router_client(fakes)
        responses = [await complete(client, f"p{i}") for i in range(3)]
        assert all(r.status_code == 200 for r in responses)
        assert fakes.served == {A: [], B: ["p0", "p1", "p2"]}
        found = metrics((await client.get("/metrics")).text)
        assert found["goodserve:router_retries_total"] == 1  # afterwards A is out: no more tries there
        assert found[f"goodserve:router_requests_total{{backend={A},outcome=connect_error}}"] == 1
        assert found[f"goodserve:router_backend_healthy{{backend={A}}}"] == 0
        assert (await client.get("/health")).status_code == 200
    run(scenario())


def test_a_reset_before_the_response_is_retried_without_taking_the_replica_out():
    async def scenario():
        fakes = FakeReplicas()
        fakes.reset.add(A)
        client, app = router_client(fakes)
        assert (await complete(client, "p")).status_code == 200
        assert fakes.served == {A: [], B: ["p"]}
        assert app.state.router.backends[0].healthy  # the health check judges it
    run(scenario())


def test_a_draining_replica_s_503_is_retried_elsewhere():
    async def scenario():
        fakes = FakeReplicas()
        fakes.draining.add(A)
        client, _ = router_client(fakes)
        assert (await complete(client, "p")).status_code == 200
        assert fakes.served[B] == ["p"]
    run(scenario())


def test_a_stream_that_broke_after_it_began_is_never_retried():
    async def scenario():
        fakes = FakeReplicas()
        fakes.broken.add(A)
        client, _ = router_client(fakes)
        with pytest.raises(httpx2.ReadError):
            await complete(client, "p")
        assert fakes.served == {A: ["p"], B: []}
        found = metrics((await client.get("/metrics")).text)
        assert found.get("goodserve:router_retries_total", 0) == 0
        assert found[f"goodserve:router_requests_total{{backend={A},outcome=stream_error}}"] == 1
        assert found[f"goodserve:router_in_flight_requests{{backend={A}}}"] == 0
    run(scenario())


def test_health_checks_take_a_replica_out_and_put_it_back():
    async def scenario():
        fakes = FakeReplicas()
        client, app = router_client(fakes)
        fakes.unhealthy.add(A)
        await app.state.health.check_all()
        assert [await complete(client, f"p{i}") for i in range(2)] and fakes.served[A] == []
        fakes.unhealthy.clear()
        await app.state.health.check_all()
        assert app.state.router.backends[0].scraped_requests == 3  # the replica's queue, from its /metrics
        await complete(client, "p2")
        await complete(client, "p3")
        assert len(fakes.served[A]) == 1
        fakes.down |= {A, B}
        await app.state.health.check_all()
        assert (await client.get("/health")).status_code == 503
        response = await complete(client, "p4")
        assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
    run(scenario())


def test_queued_requests_reads_running_and_waiting_from_a_replica_s_metrics():
    text = ('goodserve:num_requests_running{model_name="m"} 4.0\n'
            'goodserve:num_requests_waiting{model_name="m"} 2.0\n'
            'goodserve:kv_cache_usage_perc{model_name="m"} 0.5\n')
    assert queued_requests(text) == 6
