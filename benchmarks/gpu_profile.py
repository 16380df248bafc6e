"""Where a decode step's GPU time goes: torch.profiler over eager decode steps (no CUDA graph, so
each kernel is visible), printed as a table of the kernels with the most device time.

    python benchmarks/gpu_profile.py [--model dummy:llama-3.1-8b] [--batch 1]
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from goodserve import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args()
    llm = LLM(args.model, device="cuda", enforce_eager=True, max_num_seqs=max(8, args.batch))
    engine = llm.engine
    rng = np.random.default_rng(0)
    for i in range(args.batch):
        engine.add_request(f"r{i}", rng.integers(100, 20000, args.context).tolist(),
                           SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    for _ in range(8):  # prefill and warm-up
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"gpu_profile_b{args.batch}.txt"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
