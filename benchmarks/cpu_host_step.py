"""The engine's host time a step at large batches: what the GPU cannot hide when a step cannot
launch ahead (a prompt chunk in it), measured on the CPU, where it is all there is to measure.

The model is dummy:tiny (2 layers of 64 wide), so a step is nearly all host work: scheduling, input
building, sampling bookkeeping, output recording and delivery to each request's asyncio stream.
R requests (32-token prompts, --max-tokens greedy tokens, ignore_eos) run three ways, each in a fresh
engine: Engine.step() alone; through AsyncEngine.generate, each stream read by a task that does
nothing else; and through goodserve bench's in-process target (bench/inprocess.py, what gpu_slo.py
runs: each token timed and recorded in the engine's process, under its GIL). Per way, the median and
the longest of the engine thread's step() calls while all R decode, and the longest full (generation
2) garbage collection meanwhile: one stops every stream for as long as it takes (engine/processes/gc_pauses.py).
--versions compares checkouts' src/ (each imported in processes of its own), alternated within each run;
--policies continuous,slo the scheduling policies the same way (under slo every request carries targets
loose enough never to bind, so what differs is the policy's own host work), each engine step then also
followed by the SLO forecast the engine process sends with every step ("forecast" among the phases).
--tokenizer DIR streams text as a server does (dummy:tiny has no tokenizer of its own, so without it
nothing is detokenized; the bench client's way, which sends text, is left out then, since the
tokenizer's ids do not fit dummy:tiny's vocabulary): benchmarks/export_tokenizer.py writes the embedded model's.

    OMP_NUM_THREADS=1 python benchmarks/cpu_host_step.py --rows 64,256,448 \\
        [--versions before=/path/to/old/src,after=src] [--runs 3] [--max-tokens 128] [--tokenizer DIR]

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
from result_file import cpu_model_name, write_result  # noqa: E402

PROMPT_LEN, WARMUP_STEPS, TAIL_STEPS = 32, 8, 8
WAYS = ("engine", "async_engine", "bench_client")
PHASES = ("schedule", "prepare", "forward", "sample", "detokenize", "output")
KEYS = tuple(f"{way}_{what}" for way in WAYS for what in ("step_ms", "max_step_ms", "gen2_max_ms"))


def measure(rows: int, max_tokens: int, tokenizer: str | None, policy: str = "continuous") -> dict:
    """In this process, on whatever goodserve PYTHONPATH gives: per way, the median and the longest
    decode step and the longest full (generation 2) collection while it ran, ms."""
    import asyncio
    import gc
    import time

    from goodserve.bench.inprocess import InProcessTarget
    from goodserve.bench.workloads import BenchRequest
    from goodserve.config import EngineConfig
    from goodserve.engine.frontend.async_engine import AsyncEngine
    from goodserve.engine.frontend.engine import Engine
    from goodserve.sampling_params import SamplingParams

    config = EngineConfig(model="dummy:tiny", device="cpu", max_num_seqs=rows, max_num_batched_tokens=8192,
                          num_kv_blocks=rows * (2 + (PROMPT_LEN + max_tokens) // 16), max_model_len=1024, tokenizer=tokenizer,
                          scheduler_policy=policy)
    targets = {"slo_ttft_ms": 60_000.0, "slo_tpot_ms": 1_000.0} if policy == "slo" else {}
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, **targets)
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

    gen2: list[float] = []  # full collections' seconds, from the first step of a way on
    started_at: list[float] = []

    def on_collection(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started_at[:] = [time.perf_counter()]
            elif started_at:
                gen2.append(time.perf_counter() - started_at[0])
    gc.callbacks.append(on_collection)

    def summary(way: str, step_times: list[float]) -> dict:
        decode = step_times[WARMUP_STEPS:-TAIL_STEPS]
        result = {f"{way}_step_ms": 1000 * statistics.median(decode), f"{way}_max_step_ms": 1000 * max(decode),
                  f"{way}_gen2_max_ms": 1000 * max(gen2, default=0.0)}
        gen2.clear()
        return result

    engine = Engine(config)
    times = timed(engine)
    gen2.clear()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    forecast_s = 0.0
    while engine.has_unfinished():
        engine.step()
        started = time.perf_counter()
        engine.scheduler.forecast()
        forecast_s += time.perf_counter() - started
    result = summary("engine", times)
    # where the engine's step time went, ms a step over the whole run ("detokenize": recording a
    # step's tokens, stop checks and text included)
    result["engine_phase_ms"] = {phase: 1000 * getattr(engine.steps, phase) / engine.steps.num_steps
                                 for phase in PHASES}
    result["engine_phase_ms"]["forecast"] = 1000 * forecast_s / engine.steps.num_steps

    async def streamed() -> list[float]:
        async_engine = AsyncEngine(engine=Engine(config))
        step_times = timed(async_engine.engine)
        await async_engine.start()
        gen2.clear()

        async def consume(i: int) -> None:
            async for _ in async_engine.generate(f"r{i}", prompts[i], params):
                pass
        await asyncio.gather(*(consume(i) for i in range(rows)))
        await async_engine.shutdown()
        return step_times

    async def bench_client() -> list[float]:
        """As gpu_slo.py drives the engine: each stream read by goodserve bench's in-process target."""
        target = InProcessTarget(config, ignore_eos=True)
        step_times = timed(target.engine.engine)
        await target.start()
        gen2.clear()
        request = BenchRequest(prompt="", prompt_len=PROMPT_LEN, output_len=max_tokens)
        await asyncio.gather(*(target.send(request, i, time.perf_counter) for i in range(rows)))
        await target.close()
        return step_times

    result.update(summary("async_engine", asyncio.run(streamed())))
    if tokenizer is None:
        result.update(summary("bench_client", asyncio.run(bench_client())))
    return {"rows": rows, "max_tokens": max_tokens, **result}


def run_version(src: str, rows: int, max_tokens: int, tokenizer: str | None, policy: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(rows), "--policies", policy,
                           "--max-tokens", str(max_tokens), *(["--tokenizer", tokenizer] if tokenizer else [])], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="64,256,448")
    p.add_argument("--versions", default="current=src", help="name=src_dir,... alternated within each run")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128, help="each request's greedy tokens")
    p.add_argument("--tokenizer", help="a tokenizer directory: the engine streams text (detokenizes) as a server does")
    p.add_argument("--policies", default="continuous", help="scheduling policies, alternated within each run")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.max_tokens, args.tokenizer, args.policies)))
        return
    policies = args.policies.split(",")
    versions = {(f"{name}/{policy}" if len(policies) > 1 else name): (src, policy)
                for name, src in (item.split("=", 1) for item in args.versions.split(",")) for policy in policies}
    results = {name: {} for name in versions}
    for rows in map(int, args.rows.split(",")):
        for run in range(args.runs):
            for name, (src, policy) in versions.items():
                r = run_version(src, rows, args.max_tokens, args.tokenizer, policy)
                results[name].setdefault(rows, []).append(r)
                print(f"{name:>8} {rows:4d} rows, run {run + 1}: " + _ms(r), flush=True)
    summary = {name: {rows: {key: statistics.median(r[key] for r in runs)
                             for key in KEYS if key in runs[0]}
                      | {f"{phase}_ms": statistics.median(r["engine_phase_ms"][phase] for r in runs)
                         for phase in (*PHASES, "forecast")}
                      for rows, runs in by_rows.items()} for name, by_rows in results.items()}
    for name, by_rows in summary.items():
        for rows, medians in by_rows.items():
            print(f"{name:>8} {rows:4d} rows, median of {args.runs}: " + _ms(medians))
    print(f"wrote {write_result('cpu_host_step.json', {'cpu': cpu_model_name(), 'versions': versions, 'tokenizer': args.tokenizer, 'runs': results, 'medians': summary})}")


def _ms(r: dict) -> str:
    return "; ".join(f"{way} {r[f'{way}_step_ms']:.2f} (max {r[f'{way}_max_step_ms']:.1f}, full collection "
                     f"{r[f'{way}_gen2_max_ms']:.1f})" for way in WAYS if f"{way}_step_ms" in r) + " ms; engine phases " + \
        ", ".join(f"{phase} {ms:.2f}" for phase, ms in (r.get("engine_phase_ms") or
                                                         {p: r[f"{p}_ms"] for p in (*PHASES, "forecast")}).items())


if __name__ == "__main__":
    main()
