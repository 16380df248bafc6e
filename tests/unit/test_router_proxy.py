"""The router's HTTP front against stand-in replicas (aiohttp servers on loopback): relay, retry,
health, metrics."""

from __future__ import annotations

import asyncio
import functools
import json
import time

import aiohttp
import httpx2
import openai
import pytest
import uvicorn
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from goodserve.router.app import build_app
from goodserve.router.config import RouterConfig
from goodserve.router.health import queued_requests
from goodserve.server.process import free_port


class FakeReplicas:
    """Two replicas on loopback, `a` and `b` (their URLs). Each answers /health, /metrics and the
    OpenAI routes; `reset` ones drop a request's connection before answering, `broken` ones stream a
    chunk and half of the next and then drop it, `draining` ones answer 503, `frozen` ones take every
    request (/health too) and never answer, as a SIGSTOPped process would, `busy` ones answer /health
    but hold the OpenAI requests, as one long generation each (`waiting` counts the requests held,
    `waiting_changed` is set at each change); `stop(url)` takes one off its port
    (connections are refused), and `held` keeps a stream's second chunk back until it is set."""

    def __init__(self):
        self.a, self.b = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
        self.reset: set[str] = set()
        self.broken: set[str] = set()
        self.unhealthy: set[str] = set()
        self.draining: set[str] = set()
        self.frozen: set[str] = set()
        self.busy: set[str] = set()
        self.waiting = 0
        self.waiting_changed = asyncio.Event()
        self.held: asyncio.Event | None = None
        self.served: dict[str, list[str]] = {self.a: [], self.b: []}
        self.runners: dict[str, web.AppRunner] = {}
        self.routers: list = []  # routers in front of them, whose clients close with them

    async def start(self) -> FakeReplicas:
        for url in (self.a, self.b):
            app = web.Application()
            app.router.add_route("*", "/{path:.*}", functools.partial(self.answer, url))
            # A handler is cancelled when its client hangs up: a frozen replica's count goes down.
            runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=5)
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

    async def never_answer(self) -> None:
        self.waiting += 1
        self.waiting_changed.set()
        try:
            await asyncio.Event().wait()
        finally:
            self.waiting -= 1
            self.waiting_changed.set()

    async def until_waiting(self, count: int) -> None:
        while self.waiting != count:
            self.waiting_changed.clear()
            await asyncio.wait_for(self.waiting_changed.wait(), 30)

    async def answer(self, url: str, request: web.Request) -> web.StreamResponse:
        path = request.path
        if url in self.frozen:
            await self.never_answer()
        if url in self.reset and path.startswith("/v1/"):
            request.transport.close()  # no response byte: the request never started here
            return web.Response()
        if path == "/health":
            return web.json_response({}, status=503 if url in self.unhealthy else 200)
        if url in self.busy and path.startswith("/v1/"):
            await self.never_answer()
        if path == "/metrics":
            return web.Response(text='goodserve:num_requests_waiting{model_name="m"} 3.0\n')
        if path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "m"}]})
        if url in self.draining:
            return web.json_response({"error": {"message": "draining"}}, status=503)
        body = await request.json()
        self.served[url].append(body["prompt"])
        # The same bytes either way; the content type says whether the router may end them with an event.
        response = web.StreamResponse(headers={"content-type": "text/event-stream" if body.get("stream")
                                               else "application/json"})
        await response.prepare(request)
        await response.write(f"data: {json.dumps({'chunk': 0, 'replica': url})}\n\n".encode())
        if url in self.broken:
            await response.write(b'data: {"chunk": 1, "repl')
        if self.held is not None:
            await self.held.wait()
        if url in self.broken:
            request.transport.abort()  # the stream breaks after it began, mid-event
            return response
        for i in (1, 2):
            await response.write(f"data: {json.dumps({'chunk': i, 'replica': url})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def router_client(fakes: FakeReplicas, policy: str = "round-robin", **settings) -> tuple[httpx2.AsyncClient, object]:
    config = RouterConfig(backends=(fakes.a, fakes.b), policy=policy, scrape_load=True, **settings)
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
        response = await asyncio.wait_for(app.state.router.forward("POST", "/v1/completions", body, {}), 30)
        chunks = response.body_iterator
        assert b'"chunk": 0' in await asyncio.wait_for(anext(chunks), 30)
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


def test_a_stream_whose_replica_dies_mid_event_ends_with_an_error_event_and_done():
    async def scenario(fakes):
        fakes.broken |= {fakes.a, fakes.b}
        fakes.held = asyncio.Event()  # the break comes once the first event was relayed
        client, app = router_client(fakes)
        body = json.dumps({"prompt": "p", "stream": True}).encode()
        response = await asyncio.wait_for(app.state.router.forward("POST", "/v1/completions", body, {}), 30)
        chunks = response.body_iterator
        relayed = await asyncio.wait_for(anext(chunks), 30)
        fakes.held.set()
        relayed += b"".join([chunk async for chunk in chunks])
        events = relayed.decode().split("\n\n")
        assert response.status_code == 200 and events[-2:] == ["data: [DONE]", ""]
        payloads = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
        assert payloads[0] == {"chunk": 0, "replica": fakes.a}  # whole events only: not the half-sent one
        assert len(payloads) == 2 and payloads[1]["error"]["code"] == 502
        assert fakes.served == {fakes.a: ["p"], fakes.b: []}  # never retried
        found = metrics((await client.get("/metrics")).text)
        assert found.get("goodserve:router_retries_total", 0) == 0
        assert found[f"goodserve:router_requests_total{{backend={fakes.a},outcome=stream_error}}"] == 1
        assert found[f"goodserve:router_in_flight_requests{{backend={fakes.a}}}"] == 0
        # The official client raises it rather than ending quietly with a short answer.
        official = openai.AsyncOpenAI(base_url="http://router/v1", api_key="unused", max_retries=0,
                                      http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)))
        stream = await official.completions.create(model="m", prompt="p", stream=True)
        with pytest.raises(openai.APIError, match="failed mid-answer"):
            async for _ in stream:
                pass
        assert fakes.served[fakes.b] == ["p"]
        # The Responses API ends a stream with its own error event (the replicas' framing).
        fakes.held = None
        response = await app.state.router.forward("POST", "/v1/responses", body, {})
        last = (await drain(response.body_iterator)).split(b"\n\n")[-2]
        event, data = last.split(b"\n")
        assert event == b"event: error" and json.loads(data.removeprefix(b"data: "))["code"] == "replica_error"
    run(scenario)


def test_a_broken_body_that_is_not_a_stream_reaches_the_client_broken():
    async def scenario(fakes):
        fakes.broken.add(fakes.a)
        _, app = router_client(fakes)
        response = await app.state.router.forward("POST", "/v1/completions", b'{"prompt": "p"}', {})
        with pytest.raises(aiohttp.ClientPayloadError):
            [chunk async for chunk in response.body_iterator]
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


def test_a_body_nested_too_deep_or_not_json_is_a_400_from_the_router():
    async def scenario(fakes):
        client, _ = router_client(fakes)
        deep = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        for body in (deep, b'{"prompt": "p",', b"\xff\xfe{"):
            response = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
        assert "too deeply" in (await client.post("/v1/chat/completions", content=deep)).json()["error"]["message"]
        assert fakes.served == {fakes.a: [], fakes.b: []}  # refused before any replica
    run(scenario)


def test_a_body_over_the_limit_is_refused_before_it_is_read_whole():
    limit = 64 << 10
    pulled = []

    async def body(chunks: int):
        for _ in range(chunks):
            pulled.append(1)
            yield b" " * (16 << 10)

    async def scenario(fakes):
        client, _ = router_client(fakes, max_body_bytes=limit)
        declared = await client.post("/v1/completions", content=body(300 << 6),  # 300 MB announced
                                     headers={"content-length": str(300 << 20)})
        assert declared.status_code == 413 and declared.json()["error"]["type"] == "request_too_large"
        assert not pulled  # refused from its Content-Length: not a byte read
        chunked = await client.post("/v1/completions", content=body(300 << 6))  # no length: counted as it comes
        assert chunked.status_code == 413 and len(pulled) == limit // (16 << 10) + 1
        fits = {"prompt": "p" * (limit - 100), "stream": True}
        assert (await client.post("/v1/completions", json=fits)).status_code == 200
    run(scenario)


def test_a_frozen_replica_s_requests_go_elsewhere_once_its_health_check_times_out():
    async def scenario(fakes):
        fakes.frozen.add(fakes.a)
        client, app = router_client(fakes, health_timeout_s=1.0)
        frozen = app.state.router.backends[0]
        asking = asyncio.create_task(complete(client, "p"))  # round-robin: to the frozen one first
        await fakes.until_waiting(1)
        await app.state.health.check(frozen)  # no answer in 1 s: out, and its waiting request moves
        response = await asyncio.wait_for(asking, 30)
        assert response.status_code == 200 and f'"replica": "{fakes.b}"' in response.text
        await fakes.until_waiting(0)  # the router closed its connections there: the frozen one holds none
        found = metrics((await client.get("/metrics")).text)
        assert found[f"goodserve:router_requests_total{{backend={fakes.a},outcome=timeout}}"] == 1
        assert found[f"goodserve:router_backend_healthy{{backend={fakes.a}}}"] == 0
        assert found[f"goodserve:router_in_flight_requests{{backend={fakes.a}}}"] == 0
        assert found["goodserve:router_retries_total"] == 1
    run(scenario)


def test_a_frozen_replica_with_none_to_take_its_request_answers_504():
    async def scenario(fakes):
        fakes.frozen.add(fakes.a)
        fakes.unhealthy.add(fakes.b)
        client, app = router_client(fakes, health_timeout_s=1.0)
        frozen, out = app.state.router.backends
        await app.state.health.check(out)
        asking = asyncio.create_task(complete(client, "p"))
        await fakes.until_waiting(1)
        await app.state.health.check(frozen)
        response = await asyncio.wait_for(asking, 30)
        assert response.status_code == 504 and response.json()["error"]["type"] == "timeout"
    run(scenario)


async def drain(chunks) -> bytes:
    return b"".join([chunk async for chunk in chunks])


async def until(condition, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "still not so after the deadline"
        await asyncio.sleep(0.05)


def test_clients_that_hang_up_before_a_non_streamed_answer_close_their_requests_on_the_replicas():
    """A non-streamed answer's headers come only with the whole answer, so no write to the client
    fails: the router hears the hang-up itself. The router served on loopback by uvicorn, as in
    production; the clients plain sockets that send a request and close."""
    async def scenario(fakes):
        fakes.busy |= {fakes.a, fakes.b}
        port = free_port()
        app = build_app(RouterConfig(backends=(fakes.a, fakes.b), policy="round-robin", port=port,
                                     health_interval_s=3600))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                               timeout_graceful_shutdown=5))
        serving = asyncio.create_task(server.serve())
        try:
            await until(lambda: server.started)
            replica_sockets = lambda: [len(fakes.runners[url].server.connections) for url in (fakes.a, fakes.b)]
            baseline = replica_sockets()  # the health checks' kept-alive connections
            body = json.dumps({"model": "m", "prompt": "p"}).encode()
            for _ in range(2):
                clients = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
                for _, writer in clients:
                    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json"
                                 b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                await fakes.until_waiting(4)
                for _, writer in clients:
                    writer.close()
                await fakes.until_waiting(0)  # each replica aborted what it held
                await until(lambda: all(b.in_flight == 0 for b in app.state.router.backends))
                # A request may have reused a kept-alive one: closed with it.
                await until(lambda: all(now <= before for now, before in zip(replica_sockets(), baseline)))
        finally:
            server.should_exit = True
            await serving
    run(scenario)


def test_a_stream_from_a_replica_that_froze_mid_answer_ends_with_an_error_event():
    async def scenario(fakes):
        fakes.held = asyncio.Event()  # the replica sends its first event, then nothing
        _, app = router_client(fakes, health_timeout_s=1.0)
        body = json.dumps({"prompt": "p", "stream": True}).encode()
        response = await asyncio.wait_for(app.state.router.forward("POST", "/v1/completions", body, {}), 30)
        chunks = response.body_iterator
        assert b'"chunk": 0' in await asyncio.wait_for(anext(chunks), 30)
        fakes.frozen.add(fakes.a)
        await app.state.health.check(app.state.router.backends[0])
        rest = await asyncio.wait_for(drain(chunks), 30)
        assert b'"code": 502' in rest and rest.endswith(b"data: [DONE]\n\n")
        assert app.state.router.backends[0].in_flight == 0
        fakes.held.set()
    run(scenario)
