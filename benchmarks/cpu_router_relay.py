"""What relaying a stream costs `goodserve router`: SSE events a second through it, and its
CPU time an event, on the CPU, without GPUs or models.

Two stand-in replicas (raw asyncio HTTP servers, so they cost next to nothing: each answers a
completion with --tokens SSE chunks, one every --interval-ms, as an engine's decode steps would) sit
behind a `goodserve router` process; a raw-socket client keeps --concurrency streams open through it,
for --seconds. The router is one Python process: its CPU time an event bounds the tokens a second
R replicas can deliver through it (the GPU run of gpu_router.py found two H100 replicas behind it
delivering 1.66x one replica's requests a second at 64 req/s offered, with the router near a core).

    PYTHONPATH=src python benchmarks/cpu_router_relay.py [--concurrency 128] [--seconds 15]

Writes $OUT/cpu_router_relay.json (./out without OUT).

`--bench-client RATE` measures the other end instead: `goodserve bench` against one stand-in replica
at RATE req/s (no router), its CPU time an event, and the TTFT and inter-token gaps it reports
beside what the replica really took (--interval-ms to the first chunk and between chunks): what
the load generator adds to what it measures when it reads ~10k events a second. Writes
$OUT/cpu_bench_client.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from goodserve.server.process import ServerProcess, free_port
from result_file import cpu_seconds, write_result

CHUNK = json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m",
                    "choices": [{"index": 0, "text": " token", "logprobs": None, "finish_reason": None}]})


async def read_request(reader: asyncio.StreamReader) -> tuple[str, str] | None:
    """(method, path) of the next request on a kept-alive connection, its body read; None at its end."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        length = next((int(line.split(":", 1)[1]) for line in lines[1:]
                       if line.lower().startswith("content-length:")), 0)
        await reader.readexactly(length)
    except (asyncio.IncompleteReadError, ConnectionError):  # the router closed a pooled connection
        return None
    return method, path


def frame(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def stream_tokens(writer: asyncio.StreamWriter, tokens: int, interval_s: float) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    event = frame(b"data: " + CHUNK.encode() + b"\n\n")
    for _ in range(tokens):
        await asyncio.sleep(interval_s)
        writer.write(event)
        await writer.drain()
    writer.write(frame(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    await writer.drain()


def replica_main(port: int, tokens: int, interval_s: float) -> None:
    """A stand-in replica: /health and /metrics answer, a POST streams `tokens` chunks."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (request := await read_request(reader)) is not None:
            method, _ = request
            if method == "POST":
                await stream_tokens(writer, tokens, interval_s)
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", port, backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


async def client_stream(port: int, body: bytes, counts: dict, deadline: float) -> None:
    """Streams back to back on one kept-alive connection until the deadline, counting events."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%s" % (len(body), body))
    try:
        while time.monotonic() < deadline:
            writer.write(request)
            await reader.readuntil(b"\r\n\r\n")
            while True:
                size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
                if size == 0:
                    await reader.readexactly(2)
                    break
                data = await reader.readexactly(size + 2)
                counts["bytes"] += size
                counts["events"] += data.count(b"data: ") - data.count(b"[DONE]")
            counts["streams"] += 1
    finally:
        writer.close()


async def drive(port: int, concurrency: int, seconds: float, pid: int) -> dict:
    body = json.dumps({"model": "m", "prompt": "hello " * 64, "max_tokens": 256, "stream": True}).encode()
    counts = {"events": 0, "bytes": 0, "streams": 0}
    await asyncio.gather(*(client_stream(port, body, counts, time.monotonic() + 2.0) for _ in range(concurrency)))
    counts.update(events=0, bytes=0, streams=0)  # the warm-up's counts out
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    await asyncio.gather(*(client_stream(port, body, counts, t0 + seconds) for _ in range(concurrency)))
    wall, cpu = time.monotonic() - t0, cpu_seconds(pid) - cpu0
    return {"concurrency": concurrency, "wall_s": wall, "events": counts["events"], "streams": counts["streams"],
            "events_per_s": counts["events"] / wall, "router_cpu_fraction_of_a_core": cpu / wall,
            "router_cpu_us_per_event": 1e6 * cpu / max(counts["events"], 1)}


def bench_client(args) -> dict:
    port = free_port()
    replica = subprocess.Popen([sys.executable, __file__, "--replica", str(port), str(args.tokens),
                                str(args.interval_ms / 1000)])
    out = tempfile.mkdtemp()
    try:
        time.sleep(2)
        started = time.monotonic()
        command = [sys.executable, "-m", "goodserve.cli", "bench", "--base-url", f"http://127.0.0.1:{port}",
                   "--model", "m", "--tokenizer", args.tokenizer, "--dataset-name", "random", "--random-input-len",
                   "32", "--random-output-len", str(args.tokens), "--ignore-eos", "--num-prompts",
                   str(args.num_prompts), "--request-rate", str(args.bench_client), "--disable-tqdm",
                   "--save-result", "--result-dir", out, "--result-filename", "b.json"]
        bench = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        _, status, usage = os.wait4(bench.pid, 0)
        wall = time.monotonic() - started
    finally:
        replica.kill()
    run = json.load(open(os.path.join(out, "b.json")))
    events = run["completed"] * args.tokens
    keys = ("request_throughput", "median_ttft_ms", "mean_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")
    return {"exit_status": status, "rate": args.bench_client, "num_prompts": args.num_prompts, "events": events,
            "true_ttft_and_itl_ms": args.interval_ms, **{k: run[k] for k in keys}, "wall_s": wall,
            "bench_cpu_s": usage.ru_utime + usage.ru_stime,
            "bench_cpu_us_per_event": 1e6 * (usage.ru_utime + usage.ru_stime) / max(events, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--interval-ms", type=float, default=20.0, help="between a stream's chunks (an engine's TPOT)")
    parser.add_argument("--policy", default="least-load")
    parser.add_argument("--bench-client", type=float, metavar="RATE", help="measure goodserve bench instead (above)")
    parser.add_argument("--num-prompts", type=int, default=600, help="--bench-client's requests")
    parser.add_argument("--tokenizer", default=".gate/tok", help="--bench-client's (benchmarks/export_tokenizer.py)")
    args = parser.parse_args()
    if args.bench_client:
        result = {"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                  "event_loop": _event_loop(), "commit": _commit(), **bench_client(args)}
        print(json.dumps(result, indent=1))
        write_result("cpu_bench_client.json", result)
        return
    ports = [free_port(), free_port()]
    replicas = [subprocess.Popen([sys.executable, __file__, "--replica", str(p), str(args.tokens),
                                  str(args.interval_ms / 1000)]) for p in ports]
    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "goodserve.cli", "router", "--port", str(port), "--policy",
                               args.policy, "--log-level", "warning",
                               *[a for p in ports for a in ("--backend", f"http://127.0.0.1:{p}")]])
    front = ServerProcess(router, f"http://127.0.0.1:{port}", os.devnull)
    try:
        front.wait_ready(60)
        runs = [asyncio.run(drive(port, c, args.seconds, router.pid)) for c in args.concurrency]
    finally:
        front.stop()
        for replica in replicas:
            replica.kill()
    result = {"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
              "tokens_per_stream": args.tokens, "interval_ms": args.interval_ms, "policy": args.policy,
              "event_loop": _event_loop(), "commit": _commit(), "runs": runs}
    print(json.dumps(result, indent=1))
    write_result("cpu_router_relay.json", result)


def _commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ":/src"], cwd=here).returncode
    return head.strip() + ("-dirty" if dirty else "")


def _event_loop() -> str:
    """What uvicorn picks for the router: uvloop and httptools where installed."""
    import importlib.util

    return "+".join(name for name in ("uvloop", "httptools") if importlib.util.find_spec(name)) or "asyncio+h11"


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--replica":
        replica_main(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
    else:
        main()
