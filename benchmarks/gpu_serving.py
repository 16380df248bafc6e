"""Serving on the GPU: `goodserve serve` under Poisson load at rising rates, measured by `goodserve
bench` over HTTP; then the goodput capacity at the SLO (TTFT <= 200 ms, TPOT <= 50 ms).

The server runs dummy llama-3.1-8b (bf16) with the embedded model's tokenizer exported to a
directory (benchmarks/export_tokenizer.py), since the GGUF package is not on the GPU machine.

    python benchmarks/gpu_serving.py --tokenizer DIR [--rates 4,8,16,24,32] [--num-prompts 300]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from goodserve.server.process import launch_server

OUT = os.environ.get("OUT", "out")


def bench(url: str, args, extra: list[str], filename: str) -> dict:
    command = [sys.executable, "-m", "goodserve.cli", "bench", "--base-url", url, "--model", args.model,
               "--tokenizer", args.tokenizer, "--dataset-name", "sharegpt", "--num-prompts",
               str(args.num_prompts), "--ignore-eos", "--goodput", "ttft:200", "tpot:50",
               "--save-result", "--result-dir", OUT, "--result-filename", filename, "--disable-tqdm", *extra]
    subprocess.run(command, check=False)
    path = os.path.join(OUT, filename)
    return json.load(open(path)) if os.path.exists(path) else {"error": "no result written"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--rates", default="4,8,16,24,32", help="rates to sweep ('' for none)")
    parser.add_argument("--num-prompts", type=int, default=300)
    parser.add_argument("--capacity", action="store_true", help="also search the goodput capacity")
    parser.add_argument("--capacity-start-rate", type=float, default=8.0,
                        help="first rate probed; a start near the answer saves probes")
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    server = launch_server(["--model", args.model, "--tokenizer", args.tokenizer, "--max-num-seqs", "256",
                            "--slo-ttft-ms", "200", "--slo-tpot-ms", "50", "--log-level", "warning"], 600)
    url = server.url
    try:
        summary = {}
        if args.rates:
            summary["sweep"] = bench(url, args, ["--sweep-request-rates", args.rates], "serving_sweep.json")
        if args.capacity:
            summary["capacity"] = bench(url, args, ["--goodput-capacity", "--capacity-start-rate",
                                                    str(args.capacity_start_rate)], "serving_capacity.json")
        json.dump(summary, open(os.path.join(OUT, "gpu_serving.json"), "w"), indent=1)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
