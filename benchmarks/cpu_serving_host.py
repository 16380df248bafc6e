"""The server's host work per streamed token, on the CPU, where nothing else costs much.

`goodserve serve --model dummy:tiny` (2 layers of 64: its forward is a small part of a step, so
the step rate is the host's) under many concurrent streaming completions from an aiohttp client in
another process. Four server configurations, each run twice in the order A B C D D C B A:
uvicorn with uvloop and httptools (what goodserve installs) or with asyncio and h11 (what runs
where they are missing; a module that refuses to import hides each), times Python's collector
threshold and GIL switch interval or the serving process's own (engine/processes/gc_pauses.tune_for_serving);
or the configurations --configs names (each serving setting alone, and --stream-interval 4, too).
--versions runs each configuration on several checkouts' src/ (the server imports the one named).
Reported: output tokens/s over the whole run, the server's CPU time over it (its main thread, the
event loop, apart from the rest: the engine thread and helpers; Linux's /proc), and from the
server's /metrics the engine thread's step time by phase and the collector's share of the wall time.

    PYTHONPATH=src python benchmarks/cpu_serving_host.py [--streams 256] [--max-tokens 128]
        [--versions before=/path/to/old/src,after=src]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import aiohttp

from goodserve.diagnose.observations import observations_from_scrapes, scrape
from goodserve.server.process import launch_server
from result_file import cpu_model_name, thread_cpu_seconds

OUT = os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "results"))
PYTHON_SETTINGS = {"GOODSERVE_GC_THRESHOLD": "700", "GOODSERVE_SWITCH_INTERVAL_MS": "5"}
CONFIGS = {  # name: (uvloop and httptools, environment, serve flags)
    "uvloop+httptools, serving settings": (True, {}, []),
    "uvloop+httptools, Python's settings": (True, PYTHON_SETTINGS, []),
    "asyncio+h11, serving settings": (False, {}, []),
    "asyncio+h11, Python's settings": (False, PYTHON_SETTINGS, []),
    # each serving setting alone, and chunks of several tokens (--configs)
    "uvloop+httptools, gen0 20,000 alone": (True, {"GOODSERVE_SWITCH_INTERVAL_MS": "5"}, []),
    "uvloop+httptools, switch 0.5 ms alone": (True, {"GOODSERVE_GC_THRESHOLD": "700"}, []),
    "uvloop+httptools, --stream-interval 4": (True, {}, ["--stream-interval", "4"]),
    "uvloop+httptools, worker process": (True, {}, ["--executor-backend", "mp"]),
    # the engine's placement: its own process is now serve's default; the comparison that made it so ran
    # "serving settings" (then a thread) against --engine-process
    "uvloop+httptools, engine on a thread": (True, {}, ["--no-engine-process"]),
}
DEFAULT_CONFIGS = list(CONFIGS)[:4]


def hiding_dir() -> str:
    """A directory whose uvloop and httptools refuse to import, so uvicorn takes its fallbacks."""
    path = Path(tempfile.mkdtemp(prefix="no_fast_"))
    for name in ("uvloop", "httptools"):
        (path / name).mkdir()
        (path / name / "__init__.py").write_text(f"raise ImportError('{name} hidden by cpu_serving_host.py')\n")
    return str(path)


async def stream_one(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                     max_tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    chunks = 0
    async with session.post(f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data: {"):
                chunks += 1
    return chunks


async def load(url: str, model: str, streams: int, requests: int, max_tokens: int) -> tuple[float, int]:
    """Closed loop: `streams` clients, `requests` in all; the seconds it took and the chunks streamed."""
    remaining, chunks = requests, 0

    async def client(session, seed: int) -> None:
        nonlocal remaining, chunks
        while remaining > 0:
            remaining -= 1
            prompt = [(seed * 7 + i) % 500 + 1 for i in range(16)]
            streamed = await stream_one(session, url, model, prompt, max_tokens)
            chunks += streamed  # after the await: `chunks += await ...` would read chunks before it

    connector = aiohttp.TCPConnector(limit=streams)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(client(session, i) for i in range(streams)))
        return time.perf_counter() - start, chunks


def run(name: str, version: str, src: str, args, hidden: str) -> dict:
    fast, env, flags = CONFIGS[name]
    paths = ([] if fast else [hidden]) + [os.path.abspath(src), os.environ.get("PYTHONPATH", "")]
    env = {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    server = launch_server(["--model", "dummy:tiny", "--max-num-seqs", str(args.streams),
                            "--log-level", "warning", *flags], env=env)
    try:
        asyncio.run(load(server.url, "dummy:tiny", args.streams, args.streams // 4, 8))  # warm-up
        before, cpu_before = scrape(f"{server.url}/metrics"), thread_cpu_seconds(server.process.pid)
        seconds, chunks = asyncio.run(load(server.url, "dummy:tiny", args.streams, args.rounds * args.streams,
                                           args.max_tokens))
        after, cpu_after = scrape(f"{server.url}/metrics"), thread_cpu_seconds(server.process.pid)
    finally:
        server.stop()
    obs = observations_from_scrapes(before, after, seconds, server.url)
    row = {"config": name, "version": version, "seconds": seconds,
           "output_tok_s": args.rounds * args.streams * args.max_tokens / seconds,
           "tokens_per_chunk": args.rounds * args.streams * args.max_tokens / chunks,
           # of one core over the run: the event loop's and the engine's together are bounded near 1 by the GIL
           "server_cpu_share": {key: (cpu_after[key] - cpu_before[key]) / seconds for key in cpu_after},
           "host_share": obs.host_share, "step_phase_shares": obs.step_phase_shares,
           "gc_pause_share": obs.gc_pause_share}
    print(json.dumps({k: v for k, v in row.items() if k != "step_phase_shares"}), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--configs", type=json.loads, default=DEFAULT_CONFIGS,
                        help=f"JSON list of configuration names, of: {list(CONFIGS)}")
    parser.add_argument("--versions", default="current=src", help="name=src_dir,...: each configuration on each")
    args = parser.parse_args()
    hidden = hiding_dir()
    versions = dict(item.split("=", 1) for item in args.versions.split(","))
    runs = [(name, version) for name in args.configs for version in versions]
    rows = [run(name, version, versions[version], args, hidden) for name, version in runs + runs[::-1]]
    summary = {"machine": cpu_model_name(), "cores": os.cpu_count(), "versions": versions,
               "streams": args.streams, "max_tokens": args.max_tokens, "prompt_tokens": 16, "runs": rows,
               "output_tok_s_runs": {f"{name} ({version})": sorted(r["output_tok_s"] for r in rows
                                                                   if (r["config"], r["version"]) == (name, version))
                                     for name, version in runs}}
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "cpu_serving_host.json")
    json.dump(summary, open(path, "w"), indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
