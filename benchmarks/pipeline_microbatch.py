"""Pipeline parallelism's micro-batches against one step at a time, on an offline batch, in one run.

For each commit (its src/ in a temporary tree: commit_trees.py), a child process serves the same
offline batch with --pipeline-parallel-size M, versions alternating round by round (84b99e4 and
before run the stages one step at a time). The batch is also served once in one process (no
stages), the reference for the greedy tokens. Output tokens per second over the batch's wall time;
the engine's steps and how many were launched while others were in flight.

CPU: gloo, one process per stage, the embedded model in float32 (OMP_NUM_THREADS threads a
process). GPU: NCCL, one GPU per stage, --model dummy:llama-3.1-8b in bfloat16.

    PYTHONPATH=src python benchmarks/pipeline_microbatch.py 84b99e4 HEAD     # $OUT/pipeline_microbatch.json
    # on a GPU machine (no git there: carry an extracted tree, e.g. `git archive 84b99e4 src | tar -x -C DIR`)
    python3 benchmarks/pipeline_microbatch.py before=DIR now=. --device cuda --dtype bfloat16 \
        --model dummy:llama-3.1-8b --num-requests 128 --output-len 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from commit_trees import commit_trees, cpu_machine

REPO = Path(__file__).resolve().parent.parent
OUT = os.environ.get("OUT", str(REPO / "benchmarks" / "results"))


def workload(num_requests: int, output_len: int) -> tuple[list[dict], dict]:
    """Prompts of 16 to 256 tokens (seeded), each generating output_len tokens greedily."""
    import random

    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(rng.randrange(16, 257))]}
               for _ in range(num_requests)]
    return prompts, {"temperature": 0, "max_tokens": output_len, "ignore_eos": True}


def child(args: argparse.Namespace) -> None:
    from goodserve import LLM, SamplingParams

    prompts, params = workload(args.num_requests, args.output_len)
    params = SamplingParams(**params)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, quantization="none",
              pipeline_parallel_size=args.stages, max_num_seqs=args.max_num_seqs)
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


def run(tree: Path, args: argparse.Namespace, stages: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, __file__, "--child", "--stages", str(stages), "--model", args.model, "--device",
               args.device, "--dtype", args.dtype, "--num-requests", str(args.num_requests), "--output-len",
               str(args.output_len), "--max-num-seqs", str(args.max_num_seqs)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{tree.name} at {stages} stages failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def gpu_names() -> list[str]:
    import torch

    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("commits", nargs="*")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    runs: dict[str, list[dict]] = {commit: [] for commit in args.commits}
    with commit_trees(args.commits) as trees:
        reference = run(trees[args.commits[-1]], args, 1)
        print("one process", round(reference["output_tok_s"], 1), "tok/s", flush=True)
        for _ in range(args.rounds):
            for commit in args.commits:
                runs[commit].append(run(trees[commit], args, args.stages))
                print(commit, round(runs[commit][-1]["output_tok_s"], 1), "tok/s", flush=True)
    versions = {commit: {"output_tok_s_median": statistics.median(r["output_tok_s"] for r in rs),
                         "output_tok_s_runs": [r["output_tok_s"] for r in rs], "steps": rs[0]["steps"],
                         "pipelined_steps": rs[0]["pipelined_steps"],
                         "same_tokens_as_one_process": all(r["token_ids"] == reference["token_ids"] for r in rs)}
                for commit, rs in runs.items()}
    result = {"machine": cpu_machine() if args.device == "cpu" else {"gpus": gpu_names()},
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "workload": {"model": args.model, "dtype": args.dtype, "stages": args.stages,
                           "num_requests": args.num_requests, "prompt_tokens": "16-256", "output_len": args.output_len},
              "one_process_output_tok_s": reference["output_tok_s"], "versions": versions}
    Path(OUT).mkdir(parents=True, exist_ok=True)
    path = Path(OUT) / "pipeline_microbatch.json"
    path.write_text(json.dumps(result, indent=1))
    for commit, v in versions.items():
        print(commit, f"{v['output_tok_s_median']:.1f} tok/s, {v['pipelined_steps']} of {v['steps']} steps in flight "
              f"together, tokens {'=' if v['same_tokens_as_one_process'] else '!='} one process's")
    print("wrote", path)


if __name__ == "__main__":
    main()
