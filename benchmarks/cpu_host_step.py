"""The engine's host time a step at large batches: what the GPU cannot hide when a step cannot
launch ahead (a prompt chunk in it), measured on the CPU, where it is all there is to measure.

The model is dummy:tiny (2 layers of 64 wide), so a step is nearly all host work: scheduling, input
building, sampling bookkeeping, output recording and delivery to each request's asyncio stream.
R requests (32-token prompts, 128 greedy tokens, ignore_eos) run three ways, each in a fresh engine:
Engine.step() alone; through AsyncEngine.generate, each stream read by a task that does nothing
else; and through goodserve bench's in-process target (bench/inprocess.py, what gpu_slo.py runs:
each token timed and recorded in the engine's process, under its GIL). Per way, the median time of
the engine thread's step() calls while all R decode. --versions compares checkouts' src/ (each
imported in processes of its own), alternated within each run.

    OMP_NUM_THREADS=1 python benchmarks/cpu_host_step.py --rows 64,256,448 \\
        [--versions before=/path/to/old/src,after=src] [--runs 3]

Writes $OUT/cpu_host_step.json (benchmarks/result_file.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from result_file import write_result  # noqa: E402

PROMPT_LEN, MAX_TOKENS, WARMUP_STEPS = 32, 128, 8
KEYS = ("engine_step_ms", "async_engine_step_ms", "bench_client_step_ms")


def measure(rows: int) -> dict:
    """In this process, on whatever goodserve PYTHONPATH gives: both medians, ms."""
    import asyncio
    import time

    from goodserve.bench.inprocess import InProcessTarget
    from goodserve.bench.workloads import BenchRequest
    from goodserve.config import EngineConfig
    from goodserve.engine.async_engine import AsyncEngine
    from goodserve.engine.engine import Engine
    from goodserve.sampling_params import SamplingParams

    config = EngineConfig(model="dummy:tiny", device="cpu", max_num_seqs=rows, max_num_batched_tokens=8192,
                          num_kv_blocks=rows * 12, max_model_len=1024)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
    prompts = [[(i * 7 + j) % 500 + 1 for j in range(PROMPT_LEN)] for i in range(rows)]

    def timed(engine: Engine) -> list[float]:
        times, step = [], engine.step

        def step_and_time(*args, **kwargs):
            started = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                times.append(time.perf_counter() - started)
        engine.step = step_and_time
        return times

    engine = Engine(config)
    times = timed(engine)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished():
        engine.step()
    alone = statistics.median(times[WARMUP_STEPS:MAX_TOKENS - 8])

    async def streamed() -> float:
        async_engine = AsyncEngine(engine=Engine(config))
        step_times = timed(async_engine.engine)
        await async_engine.start()

        async def consume(i: int) -> None:
            async for _ in async_engine.generate(f"r{i}", prompts[i], params):
                pass
        await asyncio.gather(*(consume(i) for i in range(rows)))
        await async_engine.shutdown()
        return statistics.median(step_times[WARMUP_STEPS:MAX_TOKENS - 8])

    async def bench_client() -> float:
        """As gpu_slo.py drives the engine: each stream read by goodserve bench's in-process target."""
        target = InProcessTarget(config, ignore_eos=True)
        step_times = timed(target.engine.engine)
        request = BenchRequest(prompt="", prompt_len=PROMPT_LEN, output_len=MAX_TOKENS)
        await asyncio.gather(*(target.send(request, i, time.perf_counter) for i in range(rows)))
        await target.close()
        return statistics.median(step_times[WARMUP_STEPS:MAX_TOKENS - 8])

    return {"rows": rows, "engine_step_ms": 1000 * alone, "async_engine_step_ms": 1000 * asyncio.run(streamed()),
            "bench_client_step_ms": 1000 * asyncio.run(bench_client())}


def run_version(src: str, rows: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(rows)], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="64,256,448")
    p.add_argument("--versions", default="current=src", help="name=src_dir,... alternated within each run")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return
    versions = dict(item.split("=", 1) for item in args.versions.split(","))
    results = {name: {} for name in versions}
    for rows in map(int, args.rows.split(",")):
        for run in range(args.runs):
            for name, src in versions.items():
                r = run_version(src, rows)
                results[name].setdefault(rows, []).append(r)
                print(f"{name:>8} {rows:4d} rows, run {run + 1}: " + _ms(r), flush=True)
    summary = {name: {rows: {key: statistics.median(r[key] for r in runs)
                             for key in KEYS}
                      for rows, runs in by_rows.items()} for name, by_rows in results.items()}
    for name, by_rows in summary.items():
        for rows, medians in by_rows.items():
            print(f"{name:>8} {rows:4d} rows, median of {args.runs}: " + _ms(medians))
    print(f"wrote {write_result('cpu_host_step.json', {'cpu': _cpu_name(), 'versions': versions, 'runs': results, 'medians': summary})}")


def _ms(r: dict) -> str:
    return (f"Engine.step {r['engine_step_ms']:6.2f} ms, through AsyncEngine {r['async_engine_step_ms']:6.2f}, "
            f"through bench's in-process client {r['bench_client_step_ms']:6.2f}")


def _cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")


if __name__ == "__main__":
    main()
