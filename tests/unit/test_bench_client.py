"""The bench client against a small real SSE server on loopback that can misbehave on purpose,
and the bench command end to end against it: errors are recorded, partial results are written."""

import argparse
import asyncio
import json
import threading

import pytest

from goodserve.bench import command
from goodserve.bench.client import HttpTarget, HttpTargetConfig, TokenCounter, monotonic_clock
from goodserve.bench.result import load_json
from goodserve.bench.workloads import BenchRequest
from goodserve.ports import free_port

CHUNK_GAP_S = 0.02


class SseServer:
    """Answers POST /v1/completions with an OpenAI-style SSE stream. `mode` picks the behaviour:
    ok, drop (2 chunks then the connection is cut), empty ([DONE] only), error (HTTP 500),
    no_usage (no usage chunk). With die_after=N it serves N requests, then stops listening
    and cuts every later connection, like a server that crashed mid-run."""

    def __init__(self, mode="ok", die_after=None, tokens=3):
        self.mode, self.die_after, self.tokens = mode, die_after, tokens
        self.served = 0
        self.bodies = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(60)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def close(self):
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(60)

    async def _handle(self, reader, writer):
        try:
            headers = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in headers.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            body = json.loads(await reader.readexactly(length))
            if self.die_after is not None and self.served >= self.die_after:
                self.server.close()  # later connections are refused
                writer.transport.abort()
                return
            self.served += 1
            self.bodies.append(body)
            await self._respond(writer, body)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass

    async def _respond(self, writer, body):
        if self.mode == "error":
            payload = json.dumps({"error": {"message": "model exploded", "type": "server_error"}}).encode()
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(payload) + payload)
            await writer.drain()
            writer.close()
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        tokens = 0 if self.mode == "empty" else min(self.tokens, body["max_tokens"])
        for i in range(tokens):
            await asyncio.sleep(CHUNK_GAP_S)
            if "messages" in body:
                choice = {"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": None}
            else:
                choice = {"index": 0, "text": f" tok{i}", "finish_reason": None}
            self._event(writer, {"choices": [choice]})
            await writer.drain()
            if self.mode == "drop" and i == 1:
                writer.transport.abort()  # cut mid-stream: no terminating chunk
                return
        if self.mode != "no_usage":
            self._event(writer, {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": tokens}})
        writer.write(self._frame(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    def _event(self, writer, obj):
        writer.write(self._frame(b"data: " + json.dumps(obj).encode() + b"\n\n"))

    @staticmethod
    def _frame(data: bytes) -> bytes:
        return b"%x\r\n" % len(data) + data + b"\r\n"


def send_one(url, output_len=3, counter=None):
    async def go():
        target = HttpTarget(HttpTargetConfig(base_url=url), counter or TokenCounter(None))
        try:
            return await target.send(BenchRequest("hello there", 2, output_len), 0, monotonic_clock())
        finally:
            await target.close()

    return asyncio.run(go())


@pytest.fixture
def server(request):
    s = SseServer(**getattr(request, "param", {}))
    yield s
    s.close()


@pytest.mark.parametrize("server", [{"mode": "ok"}], indirect=True)
def test_streamed_request_timed_per_chunk(server):
    r = send_one(server.url)
    assert r.success, r.error
    assert (r.output_len, r.output_len_source, r.prompt_len) == (3, "usage", 7)
    assert r.generated_text == " tok0 tok1 tok2"
    assert len(r.chunk_times) == 3 and r.chunk_times == sorted(r.chunk_times)
    assert r.first_token_time == r.chunk_times[0] and r.ttft > 0
    assert r.send_time < r.first_token_time <= r.end_time
    assert len(r.itls) == 2 and r.tpot > 0


@pytest.mark.parametrize("server", [{"mode": "no_usage"}], indirect=True)
def test_counts_with_tokenizer_or_chunks_without_usage(server):
    by_chunks = send_one(server.url)
    assert by_chunks.success and (by_chunks.output_len, by_chunks.output_len_source) == (3, "chunks")
    by_words = send_one(server.url, counter=TokenCounter(lambda text: text.split()))
    assert (by_words.output_len, by_words.output_len_source) == (3, "tokenizer")


@pytest.mark.parametrize("server", [{"mode": "drop"}], indirect=True)
def test_connection_dropped_mid_stream(server):
    r = send_one(server.url)
    assert not r.success
    assert "after 2 chunks" in r.error
    assert len(r.chunk_times) == 2  # what arrived before the cut is kept


@pytest.mark.parametrize("server", [{"mode": "empty"}], indirect=True)
def test_empty_stream_is_an_error(server):
    r = send_one(server.url)
    assert not r.success and "empty stream" in r.error


@pytest.mark.parametrize("server", [{"mode": "error"}], indirect=True)
def test_http_error_message_kept(server):
    r = send_one(server.url)
    assert not r.success and r.error == "HTTP 500: model exploded"


def test_unreachable_endpoint():
    r = send_one(f"http://127.0.0.1:{free_port()}")
    assert not r.success and r.error.startswith("cannot connect to http://127.0.0.1:")


def bench_args(*argv):
    parser = argparse.ArgumentParser()
    command.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "--tokenizer", "none", "--disable-tqdm", *argv])


def test_bench_command_server_dies_mid_run_writes_partial_results(tmp_path, capsys):
    server = SseServer(mode="ok", die_after=4)
    try:
        out = tmp_path / "result.json"
        args = bench_args("--base-url", server.url, "--num-prompts", "10", "--random-input-len", "8",
                          "--random-output-len", "3", "--max-concurrency", "1", "--result-filename", str(out),
                          "--save-detailed",
                          "--save-csv", str(tmp_path / "r.csv"), "--save-html", str(tmp_path / "r.html"))
        assert command.run_command(args) == 1
    finally:
        server.close()
    result = load_json(out)
    assert (result["completed"], result["failed"], len(result["records"])) == (4, 6, 10)
    assert result["total_output_tokens"] == 12 and result["total_input_tokens"] == 28
    assert sum(bool(e) for e in result["errors"]) == 6 and len(result["errors"]) == 10
    assert "requests failed" in capsys.readouterr().err
    assert len((tmp_path / "r.csv").read_text().splitlines()) == 11
    assert "TTFT CDF" in (tmp_path / "r.html").read_text()


def test_bench_command_unreachable_endpoint_fails_before_the_run(tmp_path, capsys):
    from goodserve.cli import main

    out = tmp_path / "result.json"
    port = free_port()
    assert main(["bench", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "3",
                 "--random-input-len", "8", "--random-output-len", "3", "--result-filename", str(out)]) == 2
    captured = capsys.readouterr()
    assert f"nothing answers at http://127.0.0.1:{port}" in captured.err
    assert not out.exists() and "Successful requests" not in captured.out  # no table of zeros


def test_bench_command_malformed_dataset(tmp_path):
    bad = tmp_path / "data.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": \n')
    args = bench_args("--dataset-name", "custom", "--dataset-path", str(bad), "--num-prompts", "2")
    from goodserve.bench.workloads import DatasetError

    with pytest.raises(DatasetError, match=r"data.jsonl:2: not valid JSON"):
        command.run_command(args)


def test_sweep_over_rates_against_server(tmp_path):
    server = SseServer(mode="ok", tokens=2)
    try:
        out = tmp_path / "sweep.json"
        args = bench_args("--base-url", server.url, "--num-prompts", "4", "--random-input-len", "4",
                          "--random-output-len", "2", "--sweep-request-rates", "50,100",
                          "--goodput", "ttft:5000", "--gpu-hourly-cost", "2.5",
                          "--result-filename", str(out), "--save-html", str(tmp_path / "s.html"))
        assert command.run_command(args) == 0
    finally:
        server.close()
    result = load_json(out)
    assert [run["request_rate"] for run in result["sweep"]] == [50.0, 100.0]
    assert all(run["completed"] == 4 and run["slo_attainment"] == 100.0 for run in result["sweep"])
    assert all(run["cost_per_request"] > 0 for run in result["sweep"])
    assert "Goodput vs rate" in (tmp_path / "s.html").read_text()


@pytest.mark.parametrize("reuse", [False, True])
def test_each_run_of_a_sweep_draws_its_own_prompts(tmp_path, reuse):
    """A server's prefix cache holds what an earlier run sent: a later run of the same prompts would
    measure cache hits. Each run draws new prompts of the same lengths, unless --reuse-prompts; the
    warm-ups never send a prompt that is then measured."""
    server = SseServer(mode="ok", tokens=2)
    try:
        args = bench_args("--base-url", server.url, "--num-prompts", "3", "--random-input-len", "12",
                          "--random-output-len", "2", "--sweep-request-rates", "50,100,200", "--num-warmups", "2",
                          "--result-filename", str(tmp_path / "sweep.json"), *(["--reuse-prompts"] if reuse else []))
        assert command.run_command(args) == 0
    finally:
        server.close()
    # Each run: its 2 warm-ups, then its 3 measured requests.
    warmups = [{body["prompt"] for body in server.bodies[i * 5:i * 5 + 2]} for i in range(3)]
    runs = [sorted(body["prompt"] for body in server.bodies[i * 5 + 2:(i + 1) * 5]) for i in range(3)]
    assert all(len(prompt.split()) == 12 for run in runs for prompt in run)
    assert all(len(warmups[i]) == 2 and not warmups[i] & set(runs[i]) for i in range(3))  # none measured
    if reuse:
        assert runs[0] == runs[1] == runs[2]
    else:
        assert not set(runs[0]) & set(runs[1]) and not set(runs[1]) & set(runs[2]) and not set(runs[0]) & set(runs[2])
    seeds = [run["prompt_seed"] for run in load_json(tmp_path / "sweep.json")["sweep"]]
    assert seeds == ([0, 0, 0] if reuse else [0, 1, 2])


def test_multiturn_history_grows_with_real_answers(tmp_path):
    server = SseServer(mode="ok", tokens=2)
    try:
        args = bench_args("--base-url", server.url, "--backend", "openai-chat", "--dataset-name", "multiturn",
                          "--multiturn-num-turns", "3", "--num-prompts", "6", "--random-input-len", "4",
                          "--random-output-len", "2", "--result-filename", str(tmp_path / "m.json"))
        assert command.run_command(args) == 0
    finally:
        server.close()
    lengths = sorted(len(body["messages"]) for body in server.bodies)
    assert lengths == [1, 1, 3, 3, 5, 5]  # 2 conversations x 3 turns: user, +assistant+user, ...
    longest = max(server.bodies, key=lambda b: len(b["messages"]))["messages"]
    assert [m["role"] for m in longest] == ["user", "assistant", "user", "assistant", "user"]
    assert longest[1]["content"] == " tok0 tok1"  # the server's actual answer, fed back
    assert load_json(tmp_path / "m.json")["completed"] == 6
