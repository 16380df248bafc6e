"""The model runner's host work a step, apart from the forward: building the step's inputs from the
scheduler's rows (flattening, the int32 layout), the sampling settings, and the output's fetch
(the kept tokens). It grows with the batch, and on a GPU a step that cannot launch ahead (a prompt
chunk in it) waits for it.

A dummy:tiny engine runs R sequences (--prompt-len-token prompts, greedy or --temperature) and
records the scheduler's outputs of its steps: decode steps, then mixed ones (--new prompts of
--new-len tokens arrive while all R decode). Then the same runner replays them with its forward
replaced by fixed logits and its sampler's arithmetic by their argmax, so only the host's work is
timed: per kind of step, the median over the steps of the fastest of --repeats replays of
ModelRunner.execute_model + sample_tokens + the output's fetch.
--versions compares checkouts' src/ (each imported in a process of its own), alternated.

    OMP_NUM_THREADS=1 python benchmarks/cpu_runner_inputs.py --rows 64,256,512 \\
        [--versions before=/path/to/old/src,after=src] [--temperature 0,1]

Writes $OUT/cpu_runner_inputs.json (benchmarks/result_file.py).
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


def measure(rows: int, temperature: float, args) -> dict:
    """In this process, on whatever goodserve PYTHONPATH gives: microseconds of runner host work per
    step, median over the replays, for the decode and the mixed steps."""
    import cProfile
    import pstats
    import time

    import torch

    from goodserve.config import EngineConfig
    from goodserve.engine.frontend.engine import Engine
    from goodserve.engine.worker import model_runner
    from goodserve.engine.worker.model_inputs import ModelOutput
    from goodserve.ops.sampler import SamplerOutput
    from goodserve.sampling_params import SamplingParams

    max_tokens = 4 * args.steps
    config = EngineConfig(model="dummy:tiny", device="cpu", max_num_seqs=rows + args.new, max_num_batched_tokens=8192,
                          num_kv_blocks=(rows + args.new) * (2 + (args.new_len + args.prompt_len + max_tokens) // 16),
                          max_model_len=args.new_len + args.prompt_len + max_tokens)
    engine = Engine(config)
    executor = engine.executor
    runner = executor.worker.runner
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature, seed=None)
    recorded: list = []
    execute = executor.execute_model

    def record(out):
        recorded.append(out)
        return execute(out)
    executor.execute_model = record
    for i in range(rows):
        engine.add_request(f"r{i}", [(i * 7 + j) % 500 + 1 for j in range(args.prompt_len)], params)
    while engine.stats().last_batch_tokens != rows:
        engine.step()
    decode_from = len(recorded)
    for _ in range(args.steps):
        engine.step()
    mixed_from = len(recorded)
    for i in range(args.new):
        engine.add_request(f"n{i}", [(i * 11 + j) % 500 + 1 for j in range(args.new_len)], params)
    for _ in range(args.steps):
        engine.step()
    kinds = {"decode": [out for out in recorded[decode_from:mixed_from]],
             "mixed": [out for out in recorded[mixed_from:] if out.num_tokens > len(out)]}
    # the forward and the sampler's arithmetic (device work on a GPU) replaced: fixed logits, their argmax
    logits = torch.randn(rows + args.new, runner.vocab_size)
    tokens = logits.argmax(dim=-1)
    runner.forward = lambda inputs: ModelOutput(logits[: len(inputs.sample_rows)], {})
    model_runner.sample = lambda logits, *_: SamplerOutput(tokens[: len(logits)])

    profiler = cProfile.Profile() if args.profile else None

    def host_us(out) -> float:
        started = time.perf_counter()
        if profiler:
            profiler.enable()
        runner.execute_model(out)
        runner.sample_tokens().result()
        if profiler:
            profiler.disable()
        return 1e6 * (time.perf_counter() - started)

    result = {}
    for kind, outs in kinds.items():
        times = [min(host_us(out) for _ in range(args.repeats)) for out in outs]
        result[f"{kind}_us"] = statistics.median(times) if times else None
        result[f"{kind}_steps"] = len(times)
    if profiler:  # to stderr: stdout carries the result
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(30)
    return {"rows": rows, "temperature": temperature, **result}


def run_version(src: str, rows: int, temperature: float) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    child = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", f"{rows},{temperature}"]
    done = subprocess.run(child, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="64,256,512")
    p.add_argument("--temperature", default="0,1", help="the requests' temperatures, one run each")
    p.add_argument("--versions", default="current=src", help="name=src_dir,... alternated within each run")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=12, help="decode steps, then steps with the new prompts")
    p.add_argument("--repeats", type=int, default=5, help="replays of each step; its fastest is kept")
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--new", type=int, default=4, help="prompts arriving while the rows decode")
    p.add_argument("--new-len", type=int, default=512)
    p.add_argument("--profile", action="store_true",
                   help="with --child ROWS,TEMPERATURE: cProfile's table of the replays")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        rows, temperature = args.child.split(",")
        print(json.dumps(measure(int(rows), float(temperature), args)))
        return
    versions = dict(item.split("=", 1) for item in args.versions.split(","))
    runs: dict = {name: {} for name in versions}
    for rows in map(int, args.rows.split(",")):
        for temperature in map(float, args.temperature.split(",")):
            key = f"{rows} rows, temperature {temperature:g}"
            for run in range(args.runs):
                for name, src in (versions.items() if run % 2 == 0 else reversed(versions.items())):
                    r = run_version(src, rows, temperature)
                    runs[name].setdefault(key, []).append(r)
                    print(f"{name:>8} {key}, run {run + 1}: decode {r['decode_us']:.0f} us, mixed "
                          f"{r['mixed_us']:.0f} us a step", flush=True)
    medians = {name: {key: {kind: statistics.median(r[kind] for r in rs) for kind in ("decode_us", "mixed_us")}
                      for key, rs in by_key.items()} for name, by_key in runs.items()}
    for name, by_key in medians.items():
        for key, m in by_key.items():
            print(f"{name:>8} {key}, median of {args.runs}: decode {m['decode_us']:.0f} us, "
                  f"mixed {m['mixed_us']:.0f} us")
    result = {"cpu": cpu_model_name(), "versions": versions, "args": vars(args), "runs": runs, "medians": medians}
    print(f"wrote {write_result('cpu_runner_inputs.json', result)}")


if __name__ == "__main__":
    main()
