"""Sampling at temperature > 0 against greedy on the GPU, for checkouts' src/ side by side.

Under async scheduling the runner builds a step's sampling tensors right after launching its forward,
before the engine records the step before it; greedy batches need none (argmax only), sampled ones
need temperature, top-p, top-k and min-p on the device. If building them synchronizes (a CUDA copy
from pageable memory does), the host waits for that forward, and recording the last step no longer
overlaps it. Each version runs in a process of its own (its src/ first on PYTHONPATH): one engine
(dummy llama-3.1-8b bf16, CUDA graphs, async scheduling), then rounds that alternate a greedy run and
a temperature 0.8 / top-p 0.95 run of the same offline batch (ignore_eos). Reported per run: output
tok/s, the share of steps launched ahead (pipelined) and host seconds a step by phase.

    PYTHONPATH=/tmp/site:$PWD/src python3 benchmarks/gpu_sampling_sync.py \\
        --versions before=/path/to/old/src,after=src [--requests 256] [--rounds 2]

Writes $OUT/gpu_sampling_sync.json (benchmarks/result_file.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from result_file import gpu_names, write_result  # noqa: E402

# OpenAI's defaults are temperature 1 and top-p 1: no sort over the vocabulary, which top-p < 1 needs
MODES = {"greedy": dict(temperature=0.0), "temperature": dict(temperature=1.0),
         "top_p": dict(temperature=0.8, top_p=0.95)}
PHASES = ("schedule", "prepare", "forward", "sample", "detokenize", "output")


def measure(args) -> dict:
    """In this process, on whatever goodserve PYTHONPATH gives."""
    from goodserve import LLM, SamplingParams

    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.requests, seed=0)
    prompts = [{"prompt_token_ids": [(i * 31 + j) % (llm.spec.vocab_size - 1) + 1 for j in range(args.input_len)]}
               for i in range(args.requests)]
    modes = {mode: SamplingParams(**settings, max_tokens=args.output_len, ignore_eos=True)
             for mode, settings in MODES.items() if mode in args.modes.split(",")}
    llm.generate(prompts[:16], SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True))  # warm-up
    runs = []
    for round_index in range(args.rounds):
        for mode, params in modes.items():
            before = llm.engine.stats()
            started = time.perf_counter()
            outputs = llm.generate(prompts, params)
            seconds = time.perf_counter() - started
            after = llm.engine.stats()
            steps = after.num_steps - before.num_steps
            tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
            runs.append({"round": round_index, "mode": mode, "output_tok_s": tokens / seconds, "steps": steps,
                         "pipelined_share": (after.num_pipelined_steps - before.num_pipelined_steps) / steps,
                         "phase_ms_a_step": {p: 1000 * (getattr(after, f"{p}_seconds_total")
                                                        - getattr(before, f"{p}_seconds_total")) / steps
                                             for p in PHASES}})
    return {"runs": runs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--versions", default="current=src", help="name=src_dir,...")
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", default="greedy,temperature,top_p", help=f"of {list(MODES)}")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (with --model dummy:tiny --dtype float32)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    versions = dict(item.split("=", 1) for item in args.versions.split(","))
    results = {}
    for name, src in versions.items():
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.abspath(src),
                                                                          os.environ.get("PYTHONPATH", "")]))}
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *sys.argv[1:]], env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            results[name] = {"error": done.stderr[-3000:]}
            continue
        results[name] = json.loads(done.stdout.splitlines()[-1])
        for run in results[name]["runs"]:
            print(f"{name:>8} round {run['round']} {run['mode']:>11}: {run['output_tok_s']:8.0f} tok/s, "
                  f"{run['steps']} steps, {100 * run['pipelined_share']:.0f}% pipelined, sample "
                  f"{run['phase_ms_a_step']['sample']:.2f} ms a step", flush=True)
    print(f"wrote {write_result('gpu_sampling_sync.json', {'gpus': gpu_names(), 'model': args.model, 'dtype': args.dtype, 'requests': args.requests, 'input_len': args.input_len, 'output_len': args.output_len, 'versions': versions, 'results': results})}")


if __name__ == "__main__":
    main()
