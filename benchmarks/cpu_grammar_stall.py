"""A grammar compile beside a running stream, on the CPU: how long the stream waits for its next token
while a request with a large enum schema is admitted and served (the stream's longest gap between
tokens), against the same stream's gap with nothing beside it.

The app runs in-process over the embedded model's engine in its own process (`goodserve serve`'s
default): before grammars crossed compiled, that process compiled each one again on its step loop.
Run it against any source tree to compare versions:

    PYTHONPATH=src python benchmarks/cpu_grammar_stall.py                 # writes $OUT/cpu_grammar_stall_current.json
    PYTHONPATH=OLD/src python benchmarks/cpu_grammar_stall.py --tag old
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

import httpx2

from goodserve.config import EngineConfig
from goodserve.engine.frontend.engine_process import EngineProcess
from goodserve.sampling_params import SamplingParams
from goodserve.server.app import ServerConfig, build_app
from result_file import cpu_model_name, write_result


def enum_schema(values: int) -> dict:
    return {"type": "object", "properties": {"v": {"enum": [f"value-{i:06d}" for i in range(values)]}},
            "required": ["v"]}


async def stream_gaps(engine, request_id: str, tokens: int, started: asyncio.Event) -> list[float]:
    """The times between the stream's consecutive tokens."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0, output_kind="delta")
    times = []
    async for out in engine.generate(request_id, [1, 2, 3, 4, 5], params):
        times.extend([time.perf_counter()] * len(out.outputs[0].token_ids))
        started.set()
    return [b - a for a, b in zip(times, times[1:])]


async def beside(app, engine, values: int | None, tokens: int) -> dict:
    """The stream's longest gap, with a request for an enum of `values` strings sent once it runs."""
    started = asyncio.Event()
    stream = asyncio.create_task(stream_gaps(engine, f"innocent-{values}", tokens, started))
    await started.wait()
    reply = None
    if values is not None:
        body = {"messages": [{"role": "user", "content": "Pick one."}], "max_tokens": 24,
                "guided_json": enum_schema(values)}
        sent = time.perf_counter()
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://goodserve",
                                      timeout=3600) as client:
            reply = await client.post("/v1/chat/completions", content=json.dumps(body),
                                      headers={"content-type": "application/json"})
        answered = time.perf_counter() - sent
    gaps = await stream
    result = {"enum_values": values, "max_gap_s": max(gaps), "median_gap_s": sorted(gaps)[len(gaps) // 2]}
    if reply is not None:
        result |= {"status": reply.status_code, "answered_after_s": answered,
                   "schema_bytes": len(json.dumps(enum_schema(values)))}
    return result


async def run(values: list[int], tokens: int) -> list[dict]:
    engine = EngineProcess(EngineConfig(model="smollm2-135m", max_model_len=4096, device="cpu"))
    app = build_app(engine, ServerConfig(data_dir=tempfile.mkdtemp()))
    async with app.router.lifespan_context(app):
        await beside(app, engine, 10, 8)  # the compiler's one-time set-up, out of the measurement
        return [await beside(app, engine, v, tokens) for v in [None, *values]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--values", type=int, nargs="+", default=[7_000, 20_000])
    parser.add_argument("--tokens", type=int, default=400, help="the stream's length: it must outlast the compiles")
    parser.add_argument("--tag", default="current")
    args = parser.parse_args()
    rows = asyncio.run(run(args.values, args.tokens))
    result = {"tag": args.tag, "machine": cpu_model_name(), "rows": rows}
    print(json.dumps(result, indent=1))
    write_result(f"cpu_grammar_stall_{args.tag}.json", result)


if __name__ == "__main__":
    main()
