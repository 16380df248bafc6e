"""Prefill / decode disaggregation against colocated replicas, on 2 GPUs: one prefill GPU and
one decode GPU (`goodserve serve --disaggregate prefill:0,decode:1`) against two colocated replicas
behind the router (`goodserve serve --data-parallel-size 2`), on a long-prompt workload (random
prompts of ~2k tokens, ~200 out, gamma arrivals) at TTFT <= 200 ms / TPOT <= 50 ms.

Per setup, each on fresh servers:
- capacity: `goodserve bench --goodput-capacity` (the highest rate at which --slo-attainment-target of
  the requests meet both targets), at --burstiness;
- burst: one run at --burst-rate with bursty arrivals (--burst-burstiness < 1: gamma gaps, requests in
  clumps), so prefills pile up while others decode. Recorded: TPOT p99 and TTFT p99, SLO attainment.
  DistServe's claim to test: colocated decodes stall behind the bursts' prefills (TPOT p99 up), the
  disaggregated decode GPU does not.

    python benchmarks/gpu_disagg.py --tokenizer DIR [--phases capacity,burst] [--setups disagg,colocated]
    python benchmarks/gpu_disagg.py --smoke     # the CPU: embedded model, tiny workload, loose SLO

NCCL_NVLS_ENABLE=0 is set for every server (NVLink multicast off, as the device README asks).
Writes $OUT/gpu_disagg.json and each bench run's result file beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys

from goodserve.server.process import launch_server, scrape_metrics
from result_file import gpu_names

OUT = os.environ.get("OUT", "out")
SETUPS = {"disagg": ["--disaggregate", "prefill:0,decode:1"], "colocated": ["--data-parallel-size", "2"]}
SUMMARY_KEYS = ("completed", "request_throughput", "slo_attainment", "median_ttft_ms", "p99_ttft_ms",
                "median_tpot_ms", "p99_tpot_ms", "p99_itl_ms")


@contextlib.contextmanager
def serving(args, setup: str):
    flags = ["--model", args.model, "--log-level", "warning", *SETUPS[setup], *args.server_flags]
    if args.tokenizer:
        flags += ["--tokenizer", args.tokenizer]
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # the servers inherit it
    server = launch_server(flags, 900)
    try:
        yield server
    finally:
        server.stop()


def bench(url: str, args, extra: list[str], filename: str) -> dict:
    command = [sys.executable, "-m", "goodserve.cli", "bench", "--base-url", url, "--model", args.model,
               "--tokenizer", args.tokenizer or args.model, "--dataset-name", "random", "--random-input-len",
               str(args.input_len), "--random-output-len", str(args.output_len), "--random-range-ratio", "0.1",
               "--ignore-eos", "--goodput", f"ttft:{args.ttft_ms}", f"tpot:{args.tpot_ms}", "--percentile-metrics",
               "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", OUT,
               "--result-filename", filename, "--disable-tqdm", "--num-warmups", str(args.num_warmups), *extra]
    subprocess.run(command, check=False)
    path = os.path.join(OUT, filename)
    return json.load(open(path)) if os.path.exists(path) else {"error": "no result written"}


def kv_blocks_used(url: str) -> dict[str, float] | str:
    """After a phase: every KV block freed on both sides (0 expected). Colocated replicas sit behind a
    router, whose /metrics has no pool to report."""
    used = {k: v for k, v in scrape_metrics(url).items() if "used_kv_blocks" in k}
    return used or "not exposed here (the router's /metrics)"


def capacity_phase(args, setup: str, url: str) -> dict:
    run = bench(url, args, ["--num-prompts", str(args.num_prompts), "--goodput-capacity", "--burstiness",
                            str(args.burstiness), "--capacity-start-rate", str(args.capacity_start_rate)],
                f"disagg_capacity_{setup}.json")
    return run.get("capacity", run)


def burst_phase(args, setup: str, url: str) -> dict:
    run = bench(url, args, ["--num-prompts", str(args.num_prompts), "--request-rate", str(args.burst_rate),
                            "--burstiness", str(args.burst_burstiness)], f"disagg_burst_{setup}.json")
    return {k: run.get(k) for k in SUMMARY_KEYS} if "error" not in run else run


def smoke_defaults(args) -> None:
    """The CPU: the embedded model and a workload small enough for a minute, the SLO loose enough to meet."""
    args.model, args.tokenizer = "smollm2-135m", None
    args.input_len, args.output_len, args.num_prompts = 96, 8, 6
    args.ttft_ms, args.tpot_ms = 20000, 5000
    args.capacity_start_rate, args.burst_rate = 1.0, 2.0
    args.server_flags = ["--max-model-len", "512"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--tokenizer", help="a tokenizer directory (benchmarks/export_tokenizer.py)")
    parser.add_argument("--setups", default="disagg,colocated")
    parser.add_argument("--phases", default="capacity,burst")
    parser.add_argument("--input-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=200)
    parser.add_argument("--num-prompts", type=int, default=300)
    parser.add_argument("--ttft-ms", type=float, default=200)
    parser.add_argument("--tpot-ms", type=float, default=50)
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the capacity runs' gaps")
    parser.add_argument("--capacity-start-rate", type=float, default=8.0)
    parser.add_argument("--burst-rate", type=float, default=6.0)
    parser.add_argument("--burst-burstiness", type=float, default=0.25, help="< 1: arrivals in clumps")
    parser.add_argument("--num-warmups", type=int, default=2,
                        help="requests first, left out (the first transfers set up NCCL's communicators)")
    parser.add_argument("--smoke", action="store_true", help="run on the CPU with a tiny workload")
    args = parser.parse_args()
    args.server_flags = ["--max-num-seqs", "256"]
    if args.smoke:
        smoke_defaults(args)
    elif not args.tokenizer:
        parser.error("--tokenizer DIR is needed for a dummy model (benchmarks/export_tokenizer.py)")
    os.makedirs(OUT, exist_ok=True)
    phases = {"capacity": capacity_phase, "burst": burst_phase}
    workload = ("model", "input_len", "output_len", "num_prompts", "ttft_ms", "tpot_ms", "burstiness", "burst_rate",
                "burst_burstiness", "smoke")
    summary = {"gpus": gpu_names(), "workload": {k: getattr(args, k) for k in workload}}
    for setup in args.setups.split(","):
        with serving(args, setup) as server:
            summary[setup] = {name: phases[name](args, setup, server.url) for name in args.phases.split(",")}
            summary[setup]["kv_blocks_used_after"] = kv_blocks_used(server.url)
        # after each setup: kept if the next one times out
        json.dump(summary, open(os.path.join(OUT, "gpu_disagg.json"), "w"), indent=1)
    print(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()
