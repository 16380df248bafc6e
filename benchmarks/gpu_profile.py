"""Where a decode step's time goes: torch.profiler over decode steps, printed as a table of the
kernels with the most device time, then the engine's own per-stage host timings per step.

Eager by default (no CUDA graph, so each kernel's launch is visible too); --graphs profiles the
captured decode graphs, as the engine runs them (CUPTI still times each kernel inside a graph).

    python benchmarks/gpu_profile.py [--model dummy:llama-3.1-8b] [--batch 1] [--context 256] [--graphs] [--nopdl]
                                     [--quantization int4 [--quantize-lm-head]]
    python benchmarks/gpu_profile.py --device cpu --model smollm2-135m   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from goodserve import LLM, SamplingParams
from goodserve.config import KernelOptions

STAGES = ("schedule", "prepare", "forward", "sample", "detokenize", "output")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--graphs", action="store_true", help="replay CUDA graphs, as the engine does by default")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--nopdl", action="store_true",
                        help="programmatic dependent launch off, so a kernel's time excludes waiting for the one before")
    parser.add_argument("--quantization", help="weight-only quantization of the model (int8, int4, ...)")
    parser.add_argument("--quantize-lm-head", action="store_true", help="with --quantization: lm_head too")
    args = parser.parse_args()
    llm = LLM(args.model, device=args.device, enforce_eager=not args.graphs, max_num_seqs=max(8, args.batch),
              kernels=KernelOptions(pdl=not args.nopdl), quantization=args.quantization,
              quantize_lm_head=args.quantize_lm_head)
    engine = llm.engine
    rng = np.random.default_rng(0)
    for i in range(args.batch):
        engine.add_request(f"r{i}", rng.integers(1, min(20000, engine.spec.vocab_size), args.context).tolist(),
                           SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
    while engine.stats().last_batch_tokens != args.batch:  # prefill (in chunks) until every sequence decodes
        engine.step()
    for _ in range(3):  # warm-up
        engine.step()
    cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(5):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    sort_key = "cuda_time_total" if cuda else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_key, row_limit=25, max_name_column_width=60)
    table += "\n" + host_breakdown(engine)
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"gpu_profile_b{args.batch}_ctx{args.context}{'_graphs' if args.graphs else ''}"
                           f"{'_' + args.quantization if args.quantization else ''}.txt"), "w") as f:
        f.write(table)
    print(table)


def host_breakdown(engine, steps: int = 50) -> str:
    """Per-step milliseconds of each engine stage over `steps` unprofiled decode steps."""
    before = engine.stats()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - started) / steps * 1e3
    after = engine.stats()
    per_step = {s: (getattr(after, f"{s}_seconds_total") - getattr(before, f"{s}_seconds_total")) / steps * 1e3
                for s in STAGES}
    parts = ", ".join(f"{s} {ms:.3f}" for s, ms in per_step.items())
    return f"per decode step over {steps} steps (ms): wall {wall:.3f}; {parts} (forward includes the GPU wait)"


if __name__ == "__main__":
    main()
