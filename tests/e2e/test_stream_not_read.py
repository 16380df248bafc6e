"""A streaming client that stops reading, with its socket as the operating system made it (no small
receive buffer asked for): the server's bounded send buffer fills within a few hundred KB, the
stream's outputs pile up past --max-unsent-outputs and the engine aborts it long before max_tokens.
Small events (no logprobs): left to grow, loopback's send buffer took 4 MB of them, past this
request's whole output. A real server on loopback (the socket is the subject): slow tier."""

from __future__ import annotations

import json
import socket

import pytest
from helpers import wait_for_metrics

from goodserve.server.process import launch_server, scrape_metrics

MAX_MODEL_LEN = 1024
MAX_N = 16


@pytest.fixture(scope="module")
def server():
    server = launch_server(["--model", "dummy:tiny", "--max-model-len", str(MAX_MODEL_LEN), "--max-n", str(MAX_N),
                            "--max-unsent-outputs", "32"])
    try:
        yield server
    finally:
        server.stop()



def test_a_stream_nobody_reads_is_aborted_within_the_send_buffer(server):
    max_tokens = MAX_MODEL_LEN - 8
    before = scrape_metrics(server.url)
    # ~16 events of ~250 bytes a step: 4 KB a step, so 4 MB of buffers take the whole request
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                       "n": MAX_N}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
        m = wait_for_metrics(server.url, lambda m: m["goodserve:engine_steps_total{}"] > before["goodserve:engine_steps_total{}"]
                     and m["goodserve:num_requests_running{}"] == 0)
        assert m["goodserve:engine_steps_total{}"] - before["goodserve:engine_steps_total{}"] < max_tokens // 2
    aborted = "goodserve:request_success_total{finished_reason=abort}"  # counted once its response ends
    wait_for_metrics(server.url, lambda m: m.get(aborted, 0) == before.get(aborted, 0) + 1)
