"""Pipeline parallelism with micro-batches against one step at a time, on an offline batch, in one run.

A child process a run serves the same offline batch with --pipeline-parallel-size M, with
--pipeline-micro-batches and without, alternating round by round; the batch is also served once in
one process (no stages), the reference for the greedy tokens. Output tokens per second over the
batch's wall time; the engine's steps and how many were launched while others were in flight.

CPU: gloo, one process per stage, the embedded model in float32 (OMP_NUM_THREADS threads a
process). GPU: NCCL, one GPU per stage, e.g. --model dummy:llama-3.1-8b --dtype bfloat16.

    PYTHONPATH=src python benchmarks/pipeline_microbatch.py          # $OUT/pipeline_microbatch.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = os.environ.get("OUT", str(REPO / "benchmarks" / "results"))
MODES = {"micro-batches": True, "one step at a time": False}


def workload(num_requests: int) -> list[dict]:
    """Prompts of 16 to 256 tokens (seeded)."""
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(rng.randrange(16, 257))]}
            for _ in range(num_requests)]


def child(args: argparse.Namespace) -> None:
    from goodserve import LLM, SamplingParams

    prompts = workload(args.num_requests)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, quantization="none", max_num_seqs=args.max_num_seqs,
              pipeline_parallel_size=args.stages, pipeline_micro_batches=args.micro_batches)
    llm.generate(prompts[:4], params)  # warm-up
    steps, pipelined = llm.engine.steps.num_steps, llm.engine.steps.num_pipelined_steps
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outputs]
    print(json.dumps({"seconds": seconds, "output_tok_s": sum(map(len, tokens)) / seconds,
                      "steps": llm.engine.steps.num_steps - steps,
                      "pipelined_steps": llm.engine.steps.num_pipelined_steps - pipelined, "token_ids": tokens}))
    llm.engine.executor.shutdown()


def run(args: argparse.Namespace, stages: int, micro_batches: bool) -> dict:
    command = [sys.executable, __file__, "--child", "--stages", str(stages), "--model", args.model, "--device",
               args.device, "--dtype", args.dtype, "--num-requests", str(args.num_requests), "--output-len",
               str(args.output_len), "--max-num-seqs", str(args.max_num_seqs),
               "--micro-batches" if micro_batches else "--no-micro-batches"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{stages} stages failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine(device: str) -> dict:
    if device == "cpu":
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "?")
        return {"cpu": name, "cores": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    import torch

    return {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--micro-batches", action=argparse.BooleanOptionalAction, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    reference = run(args, 1, False)
    print("one process", round(reference["output_tok_s"], 1), "tok/s", flush=True)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode, micro_batches in MODES.items():
            runs[mode].append(run(args, args.stages, micro_batches))
            print(mode, round(runs[mode][-1]["output_tok_s"], 1), "tok/s", flush=True)
    modes = {mode: {"output_tok_s_median": statistics.median(r["output_tok_s"] for r in rs),
                    "output_tok_s_runs": [r["output_tok_s"] for r in rs], "steps": rs[0]["steps"],
                    "pipelined_steps": rs[0]["pipelined_steps"],
                    "same_tokens_as_one_process": all(r["token_ids"] == reference["token_ids"] for r in rs),
                    "same_tokens_as_one_step_at_a_time": all(
                        r["token_ids"] == runs["one step at a time"][0]["token_ids"] for r in rs)}
             for mode, rs in runs.items()}
    result = {"machine": machine(args.device),
              "workload": {"model": args.model, "dtype": args.dtype, "stages": args.stages,
                           "num_requests": args.num_requests, "prompt_tokens": "16-256", "output_len": args.output_len,
                           "max_num_seqs": args.max_num_seqs},
              "one_process_output_tok_s": reference["output_tok_s"], "modes": modes}
    Path(OUT).mkdir(parents=True, exist_ok=True)
    path = Path(OUT) / "pipeline_microbatch.json"
    path.write_text(json.dumps(result, indent=1))
    for mode, m in modes.items():
        print(f"{mode}: {m['output_tok_s_median']:.1f} tok/s, {m['pipelined_steps']} of {m['steps']} steps launched "
              f"while others were in flight, tokens {'=' if m['same_tokens_as_one_process'] else '!='} one process's")
    print("wrote", path)


if __name__ == "__main__":
    main()
