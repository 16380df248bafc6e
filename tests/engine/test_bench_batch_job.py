"""bench/batch_job.py: a batch job beside a benchmark, over the in-process engine (dummy:tiny): its
lines reach the engine at BATCH_PRIORITY, a window counts the lines finished in it and their tokens,
and stop() aborts the lines in flight."""

from __future__ import annotations

import asyncio
import time

from goodserve.bench.batch_job import BatchJob, batch_input
from goodserve.bench.workloads import BenchRequest
from goodserve.config import EngineConfig
from goodserve.engine.frontend.async_engine import AsyncEngine
from goodserve.server.batch_lines import BATCH_PRIORITY


def test_a_window_counts_the_lines_finished_in_it():
    engine = AsyncEngine(EngineConfig(model="dummy:tiny", num_kv_blocks=64))
    seen = []
    add = engine.add

    def spy(request_id, prompt, params, deliver):
        seen.append(params.priority)
        add(request_id, prompt, params, deliver)

    engine.add = spy
    requests = [BenchRequest("", 3, output_len) for output_len in (2, 3, 4, 5)]
    data = batch_input(requests, [[1, 2, 3]] * 4, "dummy:tiny")

    async def run() -> tuple:
        await engine.start()
        job = BatchJob(engine, "dummy:tiny", data, max_concurrency=2)
        start = time.perf_counter()
        job.start()
        while not job.done:
            await asyncio.sleep(0.01)
        everything, nothing = job.window(start, time.perf_counter()), job.window(0.0, start)
        await job.stop()
        await engine.shutdown(0)
        return everything, nothing

    everything, nothing = asyncio.run(run())
    assert seen == [BATCH_PRIORITY] * 4
    assert (everything.lines, everything.failed, everything.output_tokens) == (4, 0, 14)
    assert (nothing.lines, nothing.output_tokens) == (0, 0)
    assert everything.as_dict()["output_tokens_per_s"] == 14 / everything.seconds


def test_stop_aborts_the_lines_in_flight():
    engine = AsyncEngine(EngineConfig(model="dummy:tiny", num_kv_blocks=64))
    data = batch_input([BenchRequest("", 3, 500)] * 8, [[1, 2, 3]] * 8, "dummy:tiny")

    async def run() -> int:
        await engine.start()
        job = BatchJob(engine, "dummy:tiny", data, max_concurrency=2)
        job.start()
        while not engine.streams:
            await asyncio.sleep(0.01)
        await job.stop()
        while engine.streams:  # the aborted requests leave the engine
            await asyncio.sleep(0.01)
        await engine.shutdown(0)
        return len(job.finished)

    assert asyncio.run(run()) == 0
