"""The host's share of serving on the GPU, as `goodserve diagnose --metrics-url` reads it.

A real `goodserve serve` (dummy llama-3.1-8b bf16, the embedded model's tokenizer exported to a
directory: benchmarks/export_tokenizer.py) under closed-loop load from `goodserve bench` in another
process, at several concurrencies, for each server configuration (`--configs`: serve flags and
environment; by default async scheduling on, the default, and off). Once the batch is full,
`goodserve diagnose --metrics-url` scrapes the server twice and writes its JSON: the engine
thread's step time by phase (the host's share is everything outside the forward pass, whose time
includes waiting for the device), the garbage collector's pauses, and the advice; over the same
window, the server's CPU time from /proc, its event loop (main thread) apart from its engine thread.

    python benchmarks/gpu_host_share.py --tokenizer DIR [--concurrency 64,256,512]
        [--configs '{"base": {}, "gc": {"env": {"GOODSERVE_GC_THRESHOLD": "20000"}}}']

On the lent GPU machine, install .gate/whl and .gate/whl_fast (scripts/gpu_wheels.sh): without the
latter uvicorn runs on asyncio and h11 and bench on its fallback client, as an installed goodserve
does not; the summary records which of them the run had.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

from goodserve.diagnose.observations import scrape
from goodserve.server.process import launch_server
from result_file import cpu_model_name, thread_cpu_seconds

OUT = os.environ.get("OUT", "out")
WORK = tempfile.mkdtemp(prefix="host_share_")  # the device call brings back 8 files: the summary alone
DEFAULT_CONFIGS = '{"async": {"flags": ["--async-scheduling"]}, "no-async": {"flags": ["--no-async-scheduling"]}}'


def cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "goodserve.cli", *argv]


def load(server, args, concurrency: int, tag: str) -> dict:
    """One closed-loop bench at this concurrency, diagnosed from /metrics while it runs, and the
    server's threads' CPU time over diagnose's window."""
    url = server.url
    bench_file, diagnose_file = f"bench_{tag}.json", os.path.join(WORK, f"diagnose_{tag}.json")
    bench = subprocess.Popen(cli(
        "bench", "--base-url", url, "--model", args.model, "--tokenizer", args.tokenizer,
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--ignore-eos", "--temperature", str(args.temperature),
        "--num-prompts",
        str(max(args.rounds * concurrency, args.min_prompts)), "--max-concurrency", str(concurrency),
        "--disable-tqdm", "--save-result", "--result-dir", WORK, "--result-filename", bench_file),
        stdout=subprocess.DEVNULL)
    wait_for_full_batch(url, concurrency, bench)
    cpu_before, started = thread_cpu_seconds(server.process.pid), time.monotonic()
    subprocess.run(cli("diagnose", "--metrics-url", f"{url}/metrics", "--interval", str(args.interval_s),
                       "--hardware", args.hardware, "--json", diagnose_file), check=False, stdout=subprocess.DEVNULL)
    window_s = time.monotonic() - started
    # of one core: the event loop's (main thread) and the engine thread's, which share one GIL
    row: dict = {"concurrency": concurrency, "server_cpu_share": {
        key: (seconds - cpu_before[key]) / window_s for key, seconds in thread_cpu_seconds(server.process.pid).items()}}
    bench.wait()
    if os.path.exists(diagnose_file):
        report = json.load(open(diagnose_file))
        obs = report["observations"]
        shares = obs.get("step_phase_shares") or {}
        row.update(step_phase_shares=shares, host_share=1 - shares["forward"] if shares else None,
                   gc_pause_share=obs.get("gc_pause_share"), tpot_ms=1000 * obs["tpot_s"],
                   output_tok_s=obs["output_throughput"], requests_in_flight=obs["concurrency"],
                   advice=[{"symptom": a["symptom"], "evidence": a["evidence"],
                            "fixes": [f["option"] for f in a["fixes"]]} for a in report["advice"]])
    path = os.path.join(WORK, bench_file)
    if os.path.exists(path):
        result = json.load(open(path))
        row["bench"] = {k: result.get(k) for k in ("completed", "failed", "output_throughput",
                                                    "median_tpot_ms", "p99_tpot_ms", "median_ttft_ms")}
        # chunks that carried text (a token that decodes to none is not one): above 1, the server
        # sent several tokens in a chunk
        chunks = sum(len(itls) + 1 for itls in result.get("itls", []))
        row["bench"]["tokens_per_chunk"] = sum(result.get("output_lens", [])) / chunks if chunks else None
    return row


def wait_for_full_batch(url: str, concurrency: int, bench: subprocess.Popen) -> None:
    """Until the bench (whose start-up takes seconds) has its requests running, plus a settling
    second: the steady batch is what diagnose should read."""
    while bench.poll() is None and scrape(f"{url}/metrics").get("num_requests_running", 0) < 0.9 * concurrency:
        time.sleep(0.2)
    time.sleep(1.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--concurrency", default="64,256,512")
    parser.add_argument("--rounds", type=int, default=2, help="prompts = rounds x concurrency ...")
    parser.add_argument("--min-prompts", type=int, default=512, help="... or at least this many")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--interval-s", type=float, default=6.0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="the requests' (1: OpenAI's default, sampled on the device beside greedy's argmax)")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help='JSON: name -> {"flags": [serve flags], "env": {variable: value}}')
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    summary: dict = {"model": args.model, "input_len": args.input_len, "output_len": args.output_len,
                     "temperature": args.temperature, "runs": {}}
    try:
        import torch

        summary["card"] = torch.cuda.get_device_name()
    except Exception:  # the script also runs on a CPU, where the card is named by diagnose
        summary["card"] = None
    # uvicorn's C event loop and HTTP parser, and bench's client: each has a slower fallback
    summary["installed"] = {name: importlib.util.find_spec(name) is not None
                            for name in ("uvloop", "httptools", "aiohttp")}
    summary["host_cpu"] = cpu_model_name()
    summary["configs"] = configs = json.loads(args.configs)
    for name, config in configs.items():
        server = start(args, config)
        try:
            summary["runs"][name] = [load(server, args, int(c), f"{name}_{c}")
                                     for c in args.concurrency.split(",")]
        finally:
            server.stop()
        json.dump(summary, open(os.path.join(OUT, "gpu_host_share.json"), "w"), indent=1)
        for row in summary["runs"][name]:
            print(name, row["concurrency"], {k: row.get(k) for k in ("host_share", "gc_pause_share", "tpot_ms",
                                                                      "output_tok_s", "server_cpu_share")},
                  row.get("bench"), flush=True)


def start(args, config: dict):
    """The server with this configuration's flags, and its environment for the server alone."""
    return launch_server(["--model", args.model, "--tokenizer", args.tokenizer, "--max-num-seqs", "1024",
                          *config.get("flags", []), "--log-level", "warning"], 600, config.get("env"))


if __name__ == "__main__":
    main()
