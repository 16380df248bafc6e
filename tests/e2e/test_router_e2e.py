"""`goodserve router` in front of two real `goodserve serve --model dummy:tiny` processes, driven by
the official openai client: relay (streaming too), prefix affinity, and one replica killed mid-run.
A client hanging up and a replica frozen by SIGSTOP, too. One stack for the module; the tests run
in order (the last one kills a replica). dummy:tiny has no
tokenizer: prompts are token ids, and answers are read as logprobs' "token_id:N" entries."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from goodserve.server.process import ServerProcess, free_port, scrape_metrics, start_server
from helpers import HTTP_TIMEOUT_S

MODEL = "dummy:tiny"
GREEDY = dict(temperature=0.0, logprobs=1)
SYSTEM = [(7 * i) % 500 + 1 for i in range(160)]  # a shared prefix: 10 KV blocks, ~800 characters of JSON
PROMPT = [11, 12, 13, 14]
LONG = dict(max_tokens=1000, extra_body={"ignore_eos": True})  # seconds of decoding: dummy:tiny holds 1024


def start_router(backends: list[str], *flags: str) -> ServerProcess:
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="goodserve-router-", suffix=".log")[1])
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "goodserve.cli", "router", "--port", str(port), "--log-level", "warning",
             *[arg for url in backends for arg in ("--backend", url)], *flags],
            stdout=log, stderr=subprocess.STDOUT)
    return ServerProcess(process, f"http://127.0.0.1:{port}", log_path)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    replicas = [start_server(["--model", MODEL, "--data-dir", str(tmp_path_factory.mktemp(f"replica{i}"))])
                for i in range(2)]
    router = None
    try:
        for replica in replicas:
            replica.wait_ready()
        # Health checks far apart: a killed replica is found by the request that hits it (the retry path).
        router = start_router([r.url for r in replicas], "--policy", "prefix", "--health-interval-s", "60")
        router.wait_ready()
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)
        yield router, replicas, client
    finally:
        for process in [router, *replicas]:
            if process is not None:
                process.stop()


def served_per_replica(router: ServerProcess, replicas: list[ServerProcess]) -> list[float]:
    found = scrape_metrics(router.url)
    return [found.get(f"goodserve:router_requests_total{{backend={r.url},outcome=ok}}", 0) for r in replicas]


def test_completions_embeddings_and_models_through_the_router(stack):
    router, replicas, client = stack
    assert [m.id for m in client.models.list().data] == [MODEL]
    direct = openai.OpenAI(base_url=f"{replicas[0].url}/v1", api_key="unused", max_retries=0)
    expected = direct.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, **GREEDY)
    for _ in range(2):  # whichever replica takes it (the same seeded weights)
        routed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, **GREEDY)
        assert routed.choices[0].logprobs.tokens == expected.choices[0].logprobs.tokens
        assert routed.usage == expected.usage
    embedding = client.embeddings.create(model=MODEL, input=PROMPT).data[0].embedding
    assert embedding == direct.embeddings.create(model=MODEL, input=PROMPT).data[0].embedding


def test_a_stream_arrives_chunk_by_chunk_and_equals_the_whole_answer(stack):
    router, _, client = stack
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, stream=True, **GREEDY))
    streamed = [token for c in chunks for token in c.choices[0].logprobs.tokens]
    assert len(chunks) >= 16  # every SSE event relayed (one per token, and a last one)
    assert streamed == whole.choices[0].logprobs.tokens


def test_requests_sharing_a_prefix_go_to_the_replica_that_served_it(stack):
    router, replicas, client = stack
    before = served_per_replica(router, replicas)
    hits_before = [scrape_metrics(r.url)["goodserve:prefix_cache_hits_total{}"] for r in replicas]
    for i in range(6):
        client.completions.create(model=MODEL, prompt=SYSTEM + [300 + i, 7], max_tokens=2)
    gained = [after - earlier for after, earlier in zip(served_per_replica(router, replicas), before)]
    assert sorted(gained) == [0, 6], gained
    holder = gained.index(6)
    hits = [scrape_metrics(r.url)["goodserve:prefix_cache_hits_total{}"] - h for r, h in zip(replicas, hits_before)]
    assert hits[holder] > 0 and hits[1 - holder] == 0, hits
    assert scrape_metrics(router.url)["goodserve:router_decisions_total{decision=prefix_hit}"] >= 5


def finished(url: str, reason: str) -> float:
    return scrape_metrics(url).get(f"goodserve:request_success_total{{finished_reason={reason}}}", 0)


def running(url: str) -> float:
    return scrape_metrics(url)["goodserve:num_requests_running{}"]


def wait_until(condition, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not {what} after {timeout_s} s"
        time.sleep(0.05)


def test_a_client_that_hangs_up_before_a_non_streamed_answer_aborts_it_on_the_replica(stack):
    router, replicas, _ = stack
    before = [(finished(r.url, "abort"), finished(r.url, "length")) for r in replicas]
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": LONG["max_tokens"], "ignore_eos": True})
    host, port = router.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=300) as client:
        client.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n"
                       f"content-length: {len(body)}\r\n\r\n{body}".encode())
        wait_until(lambda: any(running(r.url) for r in replicas), "running on a replica")
    wait_until(lambda: not any(running(r.url) for r in replicas), "ended on the replica")
    after = [(finished(r.url, "abort"), finished(r.url, "length")) for r in replicas]
    assert sorted(a - b for (a, _), (b, _) in zip(after, before)) == [0, 1]  # aborted, not run to its end
    assert [a for _, a in after] == [b for _, b in before]
    found = scrape_metrics(router.url)
    assert all(found[f"goodserve:router_in_flight_requests{{backend={r.url}}}"] == 0 for r in replicas)


def test_a_frozen_replica_s_waiting_request_is_answered_by_the_other(stack):
    """SIGSTOP the replica answering a non-streamed request: a router that checks health every second
    takes it out when /health goes unanswered and sends the request to the other replica."""
    _, replicas, _ = stack
    router = start_router([r.url for r in replicas], "--policy", "round-robin", "--health-interval-s", "1",
                          "--health-timeout-s", "5")
    try:
        router.wait_ready()
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=120)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(client.completions.create, model=MODEL, prompt=PROMPT, **LONG)  # to replica 0
            wait_until(lambda: running(replicas[0].url), "running on replica 0")
            replicas[0].process.send_signal(signal.SIGSTOP)
            try:
                assert answer.result(timeout=120).usage.completion_tokens == LONG["max_tokens"]
                found = scrape_metrics(router.url)
            finally:
                replicas[0].process.send_signal(signal.SIGCONT)
        frozen, other = replicas[0].url, replicas[1].url
        assert found[f"goodserve:router_requests_total{{backend={frozen},outcome=timeout}}"] == 1
        assert found[f"goodserve:router_requests_total{{backend={other},outcome=ok}}"] == 1
        assert found[f"goodserve:router_backend_healthy{{backend={frozen}}}"] == 0
        wait_until(lambda: not running(frozen), "aborted on the replica that woke")  # its request's socket closed
    finally:
        router.stop()


def test_a_killed_replica_s_unstarted_requests_go_to_the_other_and_the_router_stays_up(stack):
    router, replicas, client = stack
    holder = served_per_replica(router, replicas).index(max(served_per_replica(router, replicas)))
    replicas[holder].stop(signal.SIGKILL)
    # The router still sends this prefix to the dead replica first: refused, then retried on the other.
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: client.completions.create(
            model=MODEL, prompt=SYSTEM + [400 + i], max_tokens=4), range(8)))
    assert all(a.choices[0].text is not None and a.usage.completion_tokens > 0 for a in answers)
    found = scrape_metrics(router.url)
    dead, alive = replicas[holder].url, replicas[1 - holder].url
    assert found["goodserve:router_retries_total{}"] >= 1
    assert found[f"goodserve:router_requests_total{{backend={dead},outcome=connect_error}}"] >= 1
    assert found[f"goodserve:router_backend_healthy{{backend={dead}}}"] == 0
    assert found[f"goodserve:router_backend_healthy{{backend={alive}}}"] == 1
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens
    assert router.process.poll() is None
