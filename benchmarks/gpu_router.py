"""Replicas behind `goodserve router` on the GPUs: R replicas' goodput capacity against
one replica's, and the prefix-aware policy against round-robin on the prefix_repetition workload.

Each replica serves dummy llama-3.1-8b (bf16) on its own GPU (CUDA_VISIBLE_DEVICES=i) with the
embedded model's tokenizer exported to a directory (benchmarks/export_tokenizer.py). Phases, each
with fresh replicas:

- capacity: `goodserve bench --goodput-capacity` (ShareGPT-like, TTFT <= 200 ms, TPOT <= 50 ms)
  against replica 0 alone, then against the router over R replicas (--capacity-policy). Bar: R=2
  at least 1.9x.
- prefix: prefix_repetition at --prefix-rate through the router, once per policy (round-robin,
  then prefix), each on fresh replicas whose KV pool (--prefix-kv-tokens) holds most but not all of
  the workload's distinct prefixes (32 of 40 at the defaults): round-robin sends every prefix to
  every replica and evicts, prefix keeps each on one. Recorded: TTFT p50 / p99 and the replicas' prefix-cache hit rate
  (goodserve:prefix_cache_hits / _queries). Bar: prefix beats round-robin on both.
- fixed: one replica at --fixed-rate, then R behind the router at R x that rate (R x the prompts):
  throughput and attainment side by side, and the router's CPU, in a minute or two.

    python benchmarks/gpu_router.py --tokenizer DIR [--replicas 2] [--phases capacity,prefix,fixed]

Writes $OUT/gpu_router.json (and each bench run's result file beside it), with the router's CPU use
over the routed runs (one core is its ceiling): its mean, and its peak over any 5 s. A phase takes a few minutes; run them in
separate calls when one call's time is short.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from goodserve.server.process import ServerProcess, free_port, scrape_metrics, start_server
from result_file import cpu_seconds, gpu_names

OUT = os.environ.get("OUT", "out")
SLO = ["--goodput", "ttft:200", "tpot:50"]


@contextlib.contextmanager
def replicas(args, count: int, extra: list[str]):
    """count replicas, replica i on GPU i, each started with the GPU named in its environment; they load
    side by side."""
    started = []
    try:
        for gpu in range(count):
            os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)  # start_server's child inherits it
            started.append(start_server(["--model", args.model, "--tokenizer", args.tokenizer, "--max-num-seqs",
                                         "256", "--log-level", "warning", *extra]))
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        for server in started:
            server.wait_ready(600)
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


class CpuSampler:
    """A process's CPU time read every second while it runs: its mean share of a core, and the largest
    share over any 5 s (a search's mean hides the probes at which the router was saturated)."""

    def __init__(self, pid: int):
        self.pid, self.samples, self.stop = pid, [], threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.samples.append((time.monotonic(), cpu_seconds(self.pid)))
            if self.stop.wait(1.0):
                return

    def __enter__(self) -> CpuSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.samples.append((time.monotonic(), cpu_seconds(self.pid)))

    def summary(self) -> dict:
        (t0, c0), (t1, c1) = self.samples[0], self.samples[-1]
        windows = [(c - cb) / (t - tb) for (tb, cb), (t, c) in zip(self.samples, self.samples[5:])]
        return {"router_cpu_fraction_of_a_core": (c1 - c0) / (t1 - t0),
                "router_cpu_peak_5s_fraction_of_a_core": max(windows, default=None)}


def bench(url: str, args, extra: list[str], filename: str) -> dict:
    command = [sys.executable, "-m", "goodserve.cli", "bench", "--base-url", url, "--model", args.model,
               "--tokenizer", args.tokenizer, "--save-result", "--result-dir", OUT, "--result-filename", filename,
               "--disable-tqdm", *extra]
    started = time.monotonic()
    _, _, usage = os.wait4(subprocess.Popen(command).pid, 0)
    # The load generator is one Python process too: near a core, it delays the events it times.
    client = {"bench_cpu_fraction_of_a_core": (usage.ru_utime + usage.ru_stime) / (time.monotonic() - started)}
    path = os.path.join(OUT, filename)
    return {**json.load(open(path)), **client} if os.path.exists(path) else {"error": "no result written", **client}


def capacity_workload(args, num_prompts: int) -> list[str]:
    return ["--dataset-name", "sharegpt", "--num-prompts", str(num_prompts), "--ignore-eos", *SLO,
            "--goodput-capacity", "--capacity-start-rate", str(args.capacity_start_rate)]


def capacity_phase(args) -> dict:
    """One replica alone, then all behind the router with as many prompts a replica as it had (the same
    probe length at each rate a replica sees: a shorter burst is easier to absorb). --capacity-sides
    one or routed runs one search alone (a call may not hold both with long probes); ratio: both."""
    sides = args.capacity_sides.split(",")
    result: dict = {"replicas": args.replicas, "policy": args.capacity_policy, "prompts_per_replica": args.num_prompts}
    with replicas(args, args.replicas if "routed" in sides else 1, []) as servers:
        if "one" in sides:
            alone = bench(servers[0].url, args, capacity_workload(args, args.num_prompts), "router_capacity_1.json")
            result["one_replica"] = alone.get("capacity", {})
            result["bench_cpu_fraction_of_a_core_one"] = alone["bench_cpu_fraction_of_a_core"]
        if "routed" in sides:
            with router([s.url for s in servers], args.capacity_policy) as front:
                with CpuSampler(front.process.pid) as cpu:
                    routed = bench(front.url, args, capacity_workload(args, args.num_prompts * args.replicas),
                                   f"router_capacity_{args.replicas}.json")
                result.update(cpu.summary())
                router_metrics = scrape_metrics(front.url)
            result["routed"] = routed.get("capacity", {})
            result["bench_cpu_fraction_of_a_core_routed"] = routed["bench_cpu_fraction_of_a_core"]
            result["router_metrics"] = {k: v for k, v in router_metrics.items() if k.startswith("goodserve:router")}
    one, many = result.get("one_replica", {}), result.get("routed", {})
    result["ratio"] = many.get("rate", 0) / one["rate"] if one.get("rate") and many else None
    return result


def fixed_phase(args) -> dict:
    """One replica alone at --fixed-rate, then all behind the router at R x that rate with R x the
    prompts (each replica offered what the one alone was): a quick check that the router passes R
    replicas' tokens, where a capacity search takes minutes."""
    def workload(rate: float, num_prompts: int) -> list[str]:
        return ["--dataset-name", "sharegpt", "--num-prompts", str(num_prompts), "--request-rate", str(rate),
                "--ignore-eos", *SLO]

    keys = ("completed", "request_throughput", "output_throughput", "slo_attainment", "median_ttft_ms",
            "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "bench_cpu_fraction_of_a_core")
    with replicas(args, args.replicas, []) as servers:
        one = bench(servers[0].url, args, workload(args.fixed_rate, args.num_prompts), "router_fixed_1.json")
        with router([s.url for s in servers], args.capacity_policy) as front, CpuSampler(front.process.pid) as cpu:
            many = bench(front.url, args, workload(args.fixed_rate * args.replicas, args.num_prompts * args.replicas),
                         f"router_fixed_{args.replicas}.json")
    summary = {"one_replica": {k: one.get(k) for k in keys}, "routed": {k: many.get(k) for k in keys}}
    throughput = [summary[side]["request_throughput"] for side in ("one_replica", "routed")]
    return {"replicas": args.replicas, "rate_per_replica": args.fixed_rate, **summary,
            "throughput_ratio": throughput[1] / throughput[0] if all(throughput) else None, **cpu.summary()}


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
    parser.add_argument("--capacity-sides", default="one,routed", help="one, routed, or both (the ratio)")
    parser.add_argument("--fixed-rate", type=float, default=32.0, help="the fixed phase's rate a replica")
    parser.add_argument("--prefix-rate", type=float, default=16.0)
    parser.add_argument("--num-prefixes", type=int, default=40)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--prefix-kv-tokens", type=int, default=65536,
                        help="each replica's KV pool in the prefix phase: most, not all, distinct prefixes' tokens")
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    phases = {"capacity": capacity_phase, "prefix": prefix_phase, "fixed": fixed_phase}
    summary = {"gpus": gpu_names()}
    for name in args.phases.split(","):
        summary[name] = phases[name](args)
        json.dump(summary, open(os.path.join(OUT, "gpu_router.json"), "w"), indent=1)  # kept if a later phase times out
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "router_metrics"} if isinstance(v, dict) else v
                      for k, v in summary.items()}, indent=1, default=str))


if __name__ == "__main__":
    main()
