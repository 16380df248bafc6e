"""Replicas behind `goodserve router` on the GPUs (issue 16): R replicas' goodput capacity against
one replica's, and the prefix-aware policy against round-robin on the prefix_repetition workload.

Each replica serves dummy llama-3.1-8b (bf16) on its own GPU (CUDA_VISIBLE_DEVICES=i) with the
embedded model's tokenizer exported to a directory (benchmarks/export_tokenizer.py). Phases, each
with fresh replicas:

- capacity: `goodserve bench --goodput-capacity` (ShareGPT-like, TTFT <= 200 ms, TPOT <= 50 ms)
  against replica 0 alone, then against the router over R replicas (--capacity-policy). Bar: R=2
  at least 1.9x.
- prefix: prefix_repetition at --prefix-rate through the router, once per policy (round-robin,
  then prefix), each on fresh replicas whose KV pool (--prefix-kv-tokens) holds about half of the
  workload's distinct prefixes: round-robin sends every prefix to every replica and evicts, prefix
  keeps each on one. Recorded: TTFT p50 / p99 and the replicas' prefix-cache hit rate
  (goodserve:prefix_cache_hits / _queries). Bar: prefix beats round-robin on both.

    python benchmarks/gpu_router.py --tokenizer DIR [--replicas 2] [--phases capacity,prefix]

Writes $OUT/gpu_router.json (and each bench run's result file beside it), with the router's CPU use
over the routed capacity search (one core is its ceiling). A phase takes a few minutes; run them in
separate calls when one call's time is short.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from goodserve.server.process import ServerProcess, free_port, launch_server, scrape_metrics

OUT = os.environ.get("OUT", "out")
SLO = ["--goodput", "ttft:200", "tpot:50"]


@contextlib.contextmanager
def replicas(args, count: int, extra: list[str]):
    """count replicas, replica i on GPU i, each started with the GPU named in its environment."""
    started = []
    try:
        for gpu in range(count):
            os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)  # start_server's child inherits it
            started.append(launch_server(["--model", args.model, "--tokenizer", args.tokenizer, "--max-num-seqs",
                                          "256", "--log-level", "warning", *extra], 600))
        yield started
    finally:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        for server in started:
            server.stop()


@contextlib.contextmanager
def router(urls: list[str], policy: str):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "goodserve.cli", "router", "--port", str(port), "--policy",
                                policy, "--log-level", "warning", *[a for u in urls for a in ("--backend", u)]])
    front = ServerProcess(process, f"http://127.0.0.1:{port}", Path(os.devnull))
    try:
        front.wait_ready(60)
        yield front
    finally:
        front.stop()


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time: the router is one Python process, and a core it keeps busy
    the whole run caps what R replicas can deliver through it."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench(url: str, args, extra: list[str], filename: str) -> dict:
    command = [sys.executable, "-m", "goodserve.cli", "bench", "--base-url", url, "--model", args.model,
               "--tokenizer", args.tokenizer, "--save-result", "--result-dir", OUT, "--result-filename", filename,
               "--disable-tqdm", *extra]
    subprocess.run(command, check=False)
    path = os.path.join(OUT, filename)
    return json.load(open(path)) if os.path.exists(path) else {"error": "no result written"}


def capacity_phase(args) -> dict:
    workload = ["--dataset-name", "sharegpt", "--num-prompts", str(args.num_prompts), "--ignore-eos", *SLO,
                "--goodput-capacity", "--capacity-start-rate", str(args.capacity_start_rate)]
    with replicas(args, args.replicas, []) as servers:
        one = bench(servers[0].url, args, workload, "router_capacity_1.json").get("capacity", {})
        with router([s.url for s in servers], args.capacity_policy) as front:
            started, cpu_before = time.monotonic(), cpu_seconds(front.process.pid)
            many = bench(front.url, args, workload, f"router_capacity_{args.replicas}.json").get("capacity", {})
            router_busy = (cpu_seconds(front.process.pid) - cpu_before) / (time.monotonic() - started)
            routed = scrape_metrics(front.url)
    ratio = many.get("rate", 0) / one["rate"] if one.get("rate") else None
    return {"replicas": args.replicas, "policy": args.capacity_policy, "one_replica": one, "routed": many,
            "ratio": ratio, "router_cpu_fraction_of_a_core": router_busy,
            "router_metrics": {k: v for k, v in routed.items() if k.startswith("goodserve:router")}}


def cache_counters(servers: list[ServerProcess]) -> tuple[float, float]:
    found = [scrape_metrics(s.url) for s in servers]
    return (sum(f["goodserve:prefix_cache_hits_total{}"] for f in found),
            sum(f["goodserve:prefix_cache_queries_total{}"] for f in found))


def prefix_phase(args) -> dict:
    workload = ["--dataset-name", "prefix_repetition", "--num-prompts", str(args.num_prompts), "--request-rate",
                str(args.prefix_rate), "--prefix-repetition-num-prefixes", str(args.num_prefixes),
                "--prefix-repetition-prefix-len", str(args.prefix_len), "--prefix-repetition-suffix-len", "256",
                "--prefix-repetition-output-len", "128", "--ignore-eos", *SLO]
    results = {}
    for policy in ("round-robin", "prefix"):
        with replicas(args, args.replicas, ["--num-kv-blocks", str(args.prefix_kv_tokens // 16)]) as servers:
            with router([s.url for s in servers], policy) as front:
                hits0, queries0 = cache_counters(servers)
                run = bench(front.url, args, workload, f"router_prefix_{policy}.json")
                hits, queries = cache_counters(servers)
                routed = scrape_metrics(front.url)
        results[policy] = {
            "cache_hit_rate": (hits - hits0) / max(queries - queries0, 1),
            **{k: run.get(k) for k in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "request_throughput",
                                        "slo_attainment", "completed")},
            "router_metrics": {k: v for k, v in routed.items() if k.startswith("goodserve:router")}}
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--phases", default="capacity,prefix")
    parser.add_argument("--num-prompts", type=int, default=400)
    parser.add_argument("--capacity-policy", default="least-load", help="the router's policy in the capacity phase")
    parser.add_argument("--capacity-start-rate", type=float, default=64.0)
    parser.add_argument("--prefix-rate", type=float, default=16.0)
    parser.add_argument("--num-prefixes", type=int, default=40)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--prefix-kv-tokens", type=int, default=65536,
                        help="each replica's KV pool in the prefix phase: about half the distinct prefixes' tokens")
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    phases = {"capacity": capacity_phase, "prefix": prefix_phase}
    summary = {name: phases[name](args) for name in args.phases.split(",")}
    json.dump(summary, open(os.path.join(OUT, "gpu_router.json"), "w"), indent=1)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "router_metrics"} if isinstance(v, dict) else v
                      for k, v in summary.items()}, indent=1, default=str))


if __name__ == "__main__":
    main()
