"""Auth, body size limit, admission control (429) and deadlines, on a fast random-weight model.

dummy:tiny has no tokenizer, so prompts are token ids. For "queue full", one request runs at a time
(--max-num-seqs 1) and one may wait (--max-waiting 1) on a model slow enough to keep them there.
"""

from __future__ import annotations

import time

import httpx2
import pytest

from goodserve.server.process import scrape_metrics
from helpers import HTTP_TIMEOUT_S, InProcessServer

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "dummy:tiny"
MAX_BODY = 4096
# Sampled on a 512-token vocabulary: without ignore_eos, 1 run in ~250 ends at EOS a token early.
HEALTHY_PROBE = {"prompt": [3, 4], "max_tokens": 2, "ignore_eos": True}
LONG = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 900, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def url():
    server = InProcessServer([
        "--model", MODEL, "--api-key", KEY, "--max-body-bytes", str(MAX_BODY), "--max-num-seqs", "1",
        "--max-waiting", "1", "--max-model-len", "1024",
    ])
    try:
        yield server.url
    finally:
        server.stop()


def assert_error(resp: httpx2.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["message"] and error["type"] and error["code"] == status
    return error


def assert_healthy_and_serving(url: str) -> None:
    assert httpx2.get(f"{url}/health", timeout=HTTP_TIMEOUT_S).status_code == 200
    resp = httpx2.post(f"{url}/v1/completions", headers=AUTH, json=HEALTHY_PROBE, timeout=HTTP_TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 2


def test_missing_or_wrong_key_is_401(url):
    body = {"prompt": [3, 4], "max_tokens": 2}
    assert_error(httpx2.post(f"{url}/v1/completions", json=body, timeout=HTTP_TIMEOUT_S), 401)
    assert_error(httpx2.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"},
                             timeout=HTTP_TIMEOUT_S), 401)
    assert_error(httpx2.get(f"{url}/v1/models", timeout=HTTP_TIMEOUT_S), 401)
    assert httpx2.get(f"{url}/v1/models", headers=AUTH, timeout=HTTP_TIMEOUT_S).json()["data"][0]["id"] == MODEL
    assert httpx2.get(f"{url}/metrics", timeout=HTTP_TIMEOUT_S).status_code == 200  # scrapers and probes need no key
    assert_healthy_and_serving(url)


def test_oversized_body_is_413_declared_or_chunked(url):
    big = {"prompt": list(range(2, 2000)), "max_tokens": 2}
    assert_error(httpx2.post(f"{url}/v1/completions", headers=AUTH, json=big, timeout=HTTP_TIMEOUT_S), 413)

    def chunked():  # no Content-Length: the limit is enforced while reading
        yield b'{"prompt": ['
        for _ in range(1000):
            yield b"2, 3, 4, 5, "
        yield b"6]}"

    resp = httpx2.post(f"{url}/v1/completions", headers={**AUTH, "content-type": "application/json"},
                      content=chunked(), timeout=HTTP_TIMEOUT_S)
    assert_error(resp, 413)
    assert_healthy_and_serving(url)


def test_request_that_can_never_fit_is_400_at_once(url):
    body = {"prompt": [5] * 1000, "max_tokens": 100}
    refused = httpx2.post(f"{url}/v1/completions", headers=AUTH, json=body, timeout=HTTP_TIMEOUT_S)
    assert "context" in assert_error(refused, 400)["message"]


@pytest.fixture(scope="module")
def slow_url():
    """A model slow enough on the CPU (~10 ms a step) that a 900-token request is still running while
    the test fills the queue: dummy:tiny can finish it before the third request arrives."""
    server = InProcessServer(["--model", "dummy:smollm2-135m", "--api-key", KEY, "--max-num-seqs", "1",
                            "--max-waiting", "1", "--max-model-len", "1024"])
    try:
        yield server.url
    finally:
        server.stop()


def test_full_waiting_queue_is_429_with_retry_after(slow_url):
    url, long = slow_url, {**LONG, "model": "dummy:smollm2-135m"}
    with httpx2.Client(headers=AUTH, timeout=HTTP_TIMEOUT_S) as client:
        with client.stream("POST", f"{url}/v1/completions", json=long) as running:
            assert running.status_code == 200
            next(line for line in running.iter_lines() if line.startswith("data: "))  # it is running
            with client.stream("POST", f"{url}/v1/completions", json=long) as waiting:
                assert waiting.status_code == 200  # admitted: it holds the one waiting place
                refused = client.post(f"{url}/v1/completions", json={"prompt": [3, 4], "max_tokens": 2})
                assert_error(refused, 429)
                assert int(refused.headers["Retry-After"]) >= 1
    # both streams closed: their requests are aborted and the queue has room again
    deadline = time.monotonic() + 120
    while scrape_metrics(url)["goodserve:num_requests_running{}"] > 0:
        assert time.monotonic() < deadline, "aborted requests still running"
        time.sleep(0.1)
    assert_healthy_and_serving(url)


def test_request_past_its_deadline_is_408_and_aborted(url):
    body = {**LONG, "stream": False, "request_timeout_s": 0.3}
    assert_error(httpx2.post(f"{url}/v1/completions", headers=AUTH, json=body, timeout=HTTP_TIMEOUT_S), 408)
    stream_body = {**LONG, "request_timeout_s": 0.3}
    with httpx2.stream("POST", f"{url}/v1/completions", headers=AUTH, json=stream_body, timeout=HTTP_TIMEOUT_S) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"code": 408' in lines[-2]
    assert_healthy_and_serving(url)


def test_logprobs_of_a_model_without_tokenizer_name_token_ids(url):
    body = {"prompt": [3, 4], "max_tokens": 2, "logprobs": 1, "temperature": 0}
    resp = httpx2.post(f"{url}/v1/completions", headers=AUTH, json=body, timeout=HTTP_TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    logprobs = resp.json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 2 and all(t.startswith("token_id:") for t in logprobs["tokens"])
    text_prompt = httpx2.post(f"{url}/v1/completions", headers=AUTH, json={"prompt": "hi"}, timeout=HTTP_TIMEOUT_S)
    assert "tokenizer" in assert_error(text_prompt, 400)["message"]
