"""`goodserve serve` stopped as a service manager stops it: SIGTERM to the server and its child
processes at once (the engine process, multiprocessing's resource tracker). The request in flight
finishes, then the server exits with the conventional "terminated by SIGTERM" status; with the
engine in its own process (the default) and on a thread of the server's (--no-engine-process).
The rest of the server's surface runs in process, in tests/server/test_server_openai.py."""

from __future__ import annotations

import os
import signal
import threading

import httpx2
import pytest

from goodserve.server.process import launch_server
from test_engine_process import children_of

MODEL = "smollm2-135m"


@pytest.fixture(params=[["--no-engine-process"], []], ids=["engine-thread", "engine-process"])
def server(request):
    with launch_server(["--max-model-len", "512", *request.param]) as server:
        yield server


def test_sigterm_drains_in_flight_request_then_exits(server):
    result: dict = {}
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 24, "ignore_eos": True,
            "stream": True, "temperature": 0}
    first_chunk = threading.Event()

    def consume() -> None:
        lines = []
        with httpx2.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    first_chunk.set()
        result["lines"] = lines

    reader = threading.Thread(target=consume)
    reader.start()
    assert first_chunk.wait(120)
    for pid in [server.process.pid, *children_of(server.process.pid)]:
        os.kill(pid, signal.SIGTERM)
    reader.join(120)
    # uvicorn re-raises the signal once drained: the conventional "terminated by SIGTERM" status
    assert server.process.wait(120) == -signal.SIGTERM
    lines = result["lines"]
    assert lines[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in lines[-2]
    assert "draining" in server.log()
