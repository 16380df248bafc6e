"""SLO-aware scheduling on the GPU: goodput capacity under bursty arrivals, FCFS
("continuous") against the "slo" policy.

dummy llama-3.1-8b (bf16), ShareGPT-like lengths (bench/workloads.py's synthetic profile; the model
has no tokenizer, so prompts are random token ids), gamma arrivals with burstiness 0.25, targets
TTFT <= 200 ms and TPOT <= 50 ms. FCFS runs at each sequence ceiling of --fcfs-ceilings (max_num_seqs)
and slo at --max-num-seqs: slo sizes its running batch from the TPOT target under that ceiling, so
the fair peer is FCFS at the same ceiling, and FCFS at the default 256 is what a user gets without
tuning. Each run gets an in-process engine of its own, in a process of its own (so the next gets all
the GPU memory back), driven by bench/inprocess.py at each rate of a ladder: every request carries the targets, and under "slo" the server's TTFT admission check
(engine/frontend/admission.py) refuses what the server would refuse with a 429, which counts as a miss.
With --rates auto (the default) the ladder is set from the engine's saturated throughput, measured
under the first FCFS run (--saturation-prompts sent at once; req/s completed while the batch is
full), at AUTO_LADDER times it, and every run climbs the same ladder. A probe holds its rate for --probe-seconds (at least
--min-prompts requests): long enough for the running batch to fill (--max-num-seqs sequences of
~9 s of decoding each; a short probe ends before the queue builds, and every policy passes it; at
ShareGPT-like lengths the batch grows for ~40 s, as long as the longest answers live: --settle-seconds
S starts the arrivals S earlier and scores only the requests sent after, the steady state). A
run's ladder stops at the first probe below STOP_BELOW attainment or before a probe that would
overrun its share of --budget-s (its last probe's wall time). Per probe: SLO
attainment, goodput, TTFT / TPOT percentiles, refusals, and attainment at SLO scales 0.5..2
(DistServe's attainment vs SLO scale, scored on the same requests), and the same by the engine's
own token times (`engine_side`: the client shares the engine's process and GIL). Goodput capacity: the offered
rate where the ladder's attainment crosses 90% (interpolated between rungs: DistServe's measure,
`crossing_rate`); also bench/capacity.py's (`capacity`: the best passing probe's offered rate
where it held it, else the rate it sustained, its drain tail left out). The
target: slo's crossing rate >= 1.3x FCFS's at the same ceiling (`crossing_ratio`, `meets_1_3x`);
`crossing_ratio_vs` gives it against every FCFS ceiling.

The batch phase (--phases batch; the second target) measures, under the slo policy at one
online rate (--batch-rate, else the highest rung the slo ladder passed in this run, else
BATCH_RATE_FRACTION x the saturated throughput), the online attainment of a probe alone and of the
same probe (the same requests and arrivals) beside a batch job of --batch-lines ShareGPT-like lines
sent the way the server's batch runner sends them (bench/batch_job.py: server/batch_lines.run_lines,
BATCH_PRIORITY, --batch-concurrency lines in the engine at once). It reports both attainments, the
drop in points (target <= 2, `within_2_points`), and the lines the job completed and their output
tokens/s during the probe, and the step-time fit and its relative prediction error as the probe
beside the job left them (`step_time_fit`); the job need not finish, and is stopped when the probe ends.
Per probe, its steps by the path they ran (decode graph, mixed-step graph, eager: `steps_by_path_alone`,
`steps_by_path_beside`): count, mean shape, mean measured and predicted ms (StepLog).

--shed-costly runs the slo policy's admission check as `serve --slo-shed-costly` does (the costliest
requests shed first as the queue builds, engine/frontend/admission.py).

--engine-process runs each engine in a process of its own, as `goodserve serve` does (capacity phase only).
Every probe also reports the engine's side through it (`engine`, EngineWatch: running and waiting
sequences, KV cache use, preemptions, steps and host seconds per stage), and --step-log its every
step, from the engine's --step-trace file (either way of running the engine).

--arrivals poisson|gamma and --workload sharegpt|long-prompt (~2k-token prompts, ~200-token
answers) give the other DistServe curves; the defaults are gamma and ShareGPT-like.

    # H100: ~7.5-8.5 minutes (three engine loads of ~30-45 s; probes of 20 s of arrivals and their
    # drain, ~35 s at 256 sequences and longer at 1024, where decode steps are slower; 2 for FCFS@256,
    # 2-3 for each 1024 run; --rates skips the saturation measure)
    python benchmarks/gpu_slo.py --max-num-seqs 1024 --fcfs-ceilings 256,1024 --probe-seconds 20 \
        --rates 36,45,54,63 --budget-s 360
    # H200, ~8 minutes: each policy probed around its own crossing, at the steady state (75 s of arrivals,
    # the last 35 s scored), in one call (two engine loads, four probes of ~90 s)
    python benchmarks/gpu_slo.py --engine-process --max-num-seqs 1024 --settle-seconds 40 --probe-seconds 35 \
        --fcfs-rates 63,65 --rates 78,87 --full-ladder --shed-costly --budget-s 420
    # H100: ~2.5 minutes (one engine load, 2 probes)
    python benchmarks/gpu_slo.py --phases batch --max-num-seqs 1024 --batch-rate 36.2
    # dummy:tiny on the CPU, a quick check of every path (~3-4 minutes on 2 cores)
    python benchmarks/gpu_slo.py --smoke --max-num-seqs 128 --fcfs-ceilings 64,128 --phases capacity,batch

Writes $OUT/gpu_slo.json, or with other --phases $OUT/gpu_slo_<phases>.json (benchmarks/result_file.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from goodserve.bench.arrivals import ArrivalConfig
from goodserve.bench.capacity import capacity_of
from goodserve.bench.metrics import attainment_by_slo_scale, compute_metrics
from goodserve.bench.runner import BenchRun
from goodserve.bench.text import PromptText
from goodserve.bench.workloads import WorkloadConfig, build_workload

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from result_file import write_result  # noqa: E402

POLICIES = ("continuous", "slo")
SLOS_MS = {"ttft": 200.0, "tpot": 50.0}
TARGET_ATTAINMENT = 0.9
SLO_SCALES = [0.5, 0.75, 1.0, 1.5, 2.0]
STOP_BELOW = 80.0  # percent: the ladder is past this policy's capacity
AUTO_LADDER = (0.6, 0.75, 0.9, 1.05, 1.2)  # x the saturated throughput
PHASES = ("capacity", "batch")
BATCH_RATE_FRACTION = AUTO_LADDER[0]  # the batch phase's online rate, x the saturated throughput, by default
BATCH_RAMP_S = 5.0  # the batch job runs this long before the probe beside it starts: its lines fill their slots
BATCH_SEED = 1_000_003  # its lines' lengths and prompt ids, apart from any probe's


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="dummy:tiny on the CPU, two short probes")
    p.add_argument("--phases", default="capacity",
                   help="comma-separated: capacity (both policies' ladders), batch (slo, a probe with and "
                        "without a batch job)")
    p.add_argument("--arrivals", choices=("gamma", "poisson"), default="gamma",
                   help="gamma with --burstiness, or Poisson (burstiness 1)")
    p.add_argument("--workload", choices=("sharegpt", "long-prompt"), default="sharegpt",
                   help="ShareGPT-like lengths, or ~2,000-token prompts with ~200-token answers")
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rates", default="auto", help="the ladder, req/s, or auto (x the saturated throughput)")
    p.add_argument("--fcfs-rates", help="the FCFS runs' own ladder (default: --rates): each policy probed "
                                        "around its own crossing, both in one call")
    p.add_argument("--saturation-prompts", type=int, default=400)
    p.add_argument("--burstiness", type=float, default=0.25)
    p.add_argument("--probe-seconds", type=float, default=25.0, help="arrivals per probe span this long")
    p.add_argument("--min-prompts", type=int, default=100)
    p.add_argument("--settle-seconds", type=float, default=0.0,
                   help="each probe's arrivals start this much earlier, and the requests sent in it are not "
                        "scored: the running batch grows for as long as the workload's longest answers live "
                        "(~40 s at ShareGPT-like lengths), so a probe without it scores the ramp, not the steady "
                        "state (benchmarks/BENCHMARKS.md)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="every run's token budget a step (the engine's default 2048): what `goodserve diagnose "
                        "--step-trace` advises where prompt chunks push steps past the TPOT target")
    p.add_argument("--max-num-seqs", type=int,
                   help="the sequence ceiling of the slo run (and of the batch phase); default 256 (64 with --smoke)")
    p.add_argument("--fcfs-ceilings",
                   help="comma-separated max_num_seqs of the FCFS runs, each a capacity ladder of its own "
                        "(e.g. 256,1024: the default ceiling and slo's); default: --max-num-seqs alone")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="all the runs' capacity probes, wall seconds, shared equally, what a run leaves going "
                        "to the next (each engine's load and warm-up, the saturation measure and the batch "
                        "phase come on top)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-total-len", type=int, help="prompt + output tokens at most (prompts at most half; "
                   "default 2048, 4096 for long-prompt)")
    p.add_argument("--batch-rate", type=float, help="the batch phase's online rate, req/s (default: see above)")
    p.add_argument("--batch-lines", type=int, default=10_000)
    p.add_argument("--batch-concurrency", type=int, default=64,
                   help="batch lines in the engine at once (the server's --batch-max-concurrency default)")
    p.add_argument("--warmup-requests", type=int, default=48,
                   help="sent all at once first: CUDA graphs, caches, steps of many shapes for the step-time fit")
    p.add_argument("--policy", choices=POLICIES, help="(internal) measure one policy, write --json-out")
    p.add_argument("--json-out")
    p.add_argument("--full-ladder", action="store_true",
                   help=f"probe every rung even below {STOP_BELOW:g}%% attainment (e.g. --rates 45,45,54,54: each "
                        "probe twice, its run-to-run spread; the crossing reads each rung at its mean)")
    p.add_argument("--shed-costly", action="store_true",
                   help="slo: the admission check sheds the costliest requests first as the queue builds "
                        "(`serve --slo-shed-costly`, engine/frontend/admission.py)")
    p.add_argument("--no-admission", action="store_true",
                   help="slo: admit every request (no 429 for a TTFT the queue makes impossible): what the "
                        "refusals cost or save against the same policy with them")
    p.add_argument("--engine-process", action="store_true",
                   help="the engine in a process of its own, as `goodserve serve` runs it (the client's token "
                        "handling then shares no GIL with the engine's step); capacity phase only")
    p.add_argument("--step-log", action="store_true",
                   help="capacity phase: every step of every probe (the engine's --step-trace lines) into "
                        "$OUT/gpu_slo_steps_<policy>_<max_num_seqs>.json, and each probe's steps by size")
    args = p.parse_args(argv)
    args.phases = args.phases.split(",") if isinstance(args.phases, str) else args.phases
    if not args.phases or set(args.phases) - set(PHASES):
        p.error(f"--phases takes {', '.join(PHASES)}, comma-separated")
    if args.engine_process and "batch" in args.phases:
        p.error("--phases batch runs the server's batch runner on the engine in this process: not with "
                "--engine-process")
    if args.max_total_len is None:
        args.max_total_len = 4096 if args.workload == "long-prompt" else 2048
    if args.max_num_seqs is None:
        args.max_num_seqs = 64 if args.smoke else 256
    args.fcfs_ceilings = [int(c) for c in (args.fcfs_ceilings or str(args.max_num_seqs)).split(",")]
    if args.smoke:
        args.model, args.device, args.saturation_prompts = "dummy:tiny", "cpu", 40
        args.probe_seconds, args.min_prompts, args.budget_s = 1.0, 20, 120.0
        args.max_total_len, args.warmup_requests = 1024, 16  # dummy:tiny's context
        args.batch_lines = min(args.batch_lines, 300)
    return args


def workload(rate: float, args, n: int | None = None, seed: int | None = None) -> list:
    n = n or max(args.min_prompts, round(rate * (args.settle_seconds + args.probe_seconds)))
    # The same requests for both policies at a rate; every rate its own.
    seed = args.seed + int(rate * 1000) if seed is None else seed
    if args.workload == "long-prompt":
        config = WorkloadConfig(dataset_name="random", num_prompts=n, seed=seed, random_input_len=2000,
                                random_output_len=200, random_range_ratio=0.2)
    else:
        config = WorkloadConfig(dataset_name="sharegpt", num_prompts=n, seed=seed)
    requests = build_workload(config, PromptText(None, config.seed))
    for request in requests:
        request.prompt_len = min(request.prompt_len, args.max_total_len // 2)
        request.output_len = min(request.output_len, args.max_total_len - request.prompt_len)
    return requests


def arrivals(rate: float, args) -> ArrivalConfig:
    return ArrivalConfig(rate, 1.0 if args.arrivals == "poisson" else args.burstiness)


def probe_result(rate: float, records: list) -> dict:
    metrics = compute_metrics(records, slos=SLOS_MS, percentile_metrics=("ttft", "tpot"), percentiles=(50, 90, 99),
                              offered_rate=rate)
    keep = ("num_requests", "completed", "duration", "request_throughput", "sustained_request_rate",
            "output_throughput", "request_goodput", "slo_attainment", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms")
    refused = sum("TtftUnattainable" in r.error for r in records)
    shed = sum("CostlyRequestShed" in r.error for r in records)  # --shed-costly's refusals
    return {"request_rate": rate, **{k: metrics[k] for k in keep}, "refused_429": refused, "shed_429": shed,
            "slo_scale_sweep": attainment_by_slo_scale(records, SLOS_MS, SLO_SCALES),
            "engine_side": engine_side(records)}


def engine_side(records: list) -> dict:
    """TTFT / TPOT percentiles and SLO attainment by the engine's own token times (bench/inprocess.py):
    beside the client's, what of a miss the client's late reading (one process, one GIL) made."""
    served = [r for r in records if r.success and r.engine_ttft is not None]
    ttfts = np.array([1000 * r.engine_ttft for r in served])
    tpots = np.array([1000 * r.engine_tpot for r in served if r.engine_tpot is not None])
    met = sum(1000 * r.engine_ttft <= SLOS_MS["ttft"] and (r.engine_tpot is None or 1000 * r.engine_tpot
                                                            <= SLOS_MS["tpot"]) for r in served)
    result = {"slo_attainment": 100.0 * met / len(records) if records else None}
    for name, values in (("ttft", ttfts), ("tpot", tpots)):
        for q in (50, 90, 99):
            result[f"p{q}_{name}_ms"] = float(np.percentile(values, q)) if len(values) else None
    return result


async def measure_policy(args) -> dict:
    from goodserve.bench.inprocess import InProcessTarget  # torch and the model: the child process only
    from goodserve.config import EngineConfig

    trace = os.path.join(tempfile.mkdtemp(), "steps.jsonl") if args.step_log or "batch" in args.phases else None
    config = EngineConfig(model=args.model, device=args.device, scheduler_policy=args.policy,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          seed=args.seed, step_trace=trace)
    t0 = time.perf_counter()
    target = InProcessTarget(config, ignore_eos=True, slo_ms=SLOS_MS, refuses_late=not args.no_admission,
                             engine_process=args.engine_process, shed_costly=args.shed_costly)
    result = {"policy": args.policy, "max_num_seqs": args.max_num_seqs, "admission_check": not args.no_admission,
              "shed_costly": args.shed_costly and args.policy == "slo",
              "engine_process": args.engine_process}
    try:
        warmup = workload(0, args)[:args.warmup_requests]
        await BenchRun(target, warmup, ArrivalConfig()).run()
        result["load_and_warmup_s"] = time.perf_counter() - t0
        log = StepLog(trace) if trace else None
        if "capacity" in args.phases:
            await climb_ladder(target, args, result, log if args.step_log else None)
        if "batch" in args.phases and args.policy == "slo":
            result["batch"] = await batch_phase(target, args, result, log)
        result["step_time_fit"] = step_time_report(target.engine)
    finally:
        await target.close()
    return result


async def climb_ladder(target, args, result: dict, log: StepLog | None) -> None:
    """The capacity phase: probes up the ladder, into result (probes, capacity, crossing_rate)."""
    result["probes"] = []
    if args.rates == "auto":
        result["saturation_rate"] = await saturated_throughput(target, args)
        args.rates = ",".join(f"{result['saturation_rate'] * f:.1f}" for f in AUTO_LADDER)
    deadline = time.perf_counter() + args.budget_s
    result["rates"] = args.rates
    probe_s = 0.0  # the last probe's wall time: the next one is expected to take as long
    for rate in [float(r) for r in args.rates.split(",")]:
        if time.perf_counter() + probe_s > deadline:
            result["stopped"] = f"budget spent before {rate:g} req/s"
            break
        start, since = time.perf_counter(), time.time()
        probe = await online_probe(target, args, rate)
        if log:
            probe["steps_by_size"] = by_size(log.take(since, time.time()))
            print("  steps by decode rows: " + "; ".join(
                f"{size} {b['steps']} x {b['mean_measured_ms']:.1f} ms (predicted {b['mean_predicted_ms'] or 0:.1f})"
                for size, b in probe["steps_by_size"].items()), flush=True)
        probe_s = time.perf_counter() - start
        result["probes_s"] = result.get("probes_s", 0.0) + probe_s
        result["probes"].append(probe)
        if probe["slo_attainment"] < STOP_BELOW and not args.full_ladder:
            break
    if log:
        write_result(f"gpu_slo_steps_{args.policy}_{args.max_num_seqs}.json",
                     {"fields": StepLog.FIELDS, "rows": log.rows, "probe_first_rows": log.marks})
    result["capacity"] = capacity_of(result["probes"], TARGET_ATTAINMENT)
    result["crossing_rate"] = crossing_rate(result["probes"])
    # no rung fell below the target: the crossing is somewhere above the last one
    result["crossing_is_lower_bound"] = all(p["slo_attainment"] >= TARGET_ATTAINMENT * 100 for p in result["probes"])


async def online_probe(target, args, rate: float, label: str = "") -> dict:
    watch = EngineWatch(target.engine)
    watch.start()
    try:
        records = await BenchRun(target, workload(rate, args), arrivals(rate, args), args.seed).run()
    finally:
        engine = watch.stop()
    scored = [record for record in records if record.send_time >= args.settle_seconds]
    probe = {**probe_result(rate, scored), "engine": engine, "settle_seconds": args.settle_seconds}
    print(f"{args.policy:>10}@{args.max_num_seqs} {rate:6.1f} req/s{label}: attainment {probe['slo_attainment']:5.1f}% "
          f"p99 TTFT {probe['p99_ttft_ms']:7.1f} ms p99 TPOT {probe['p99_tpot_ms']:6.1f} ms "
          f"refused {probe['refused_429']} shed {probe['shed_429']}; "
          f"by the engine's token times {_engine_summary(probe['engine_side'])}",
          flush=True)
    e = probe["engine"]
    print(f"  engine: {e['num_steps']} steps ({e['mean_step_ms'] or 0:.1f} ms each), {e['num_preemptions']} preempted, "
          f"running mean {e['mean_running']:.0f} max {e['max_running']}, waiting max {e['max_waiting']}, KV cache "
          f"max {100 * e['max_kv_cache_usage']:.0f}%, host s: schedule {e['schedule_seconds_total']:.1f} prepare "
          f"{e['prepare_seconds_total']:.1f} output {e['output_seconds_total']:.1f}", flush=True)
    return probe


class EngineWatch:
    """The engine's state through a probe, from the stats it publishes after each step (read here as
    `serve`'s /metrics reads them, in or out of its process): running and waiting sequences and the
    KV cache's use, sampled every SAMPLE_S; and what the probe added to its counters (steps,
    preemptions, host seconds per stage). Whether a probe that misses its targets ran out of KV
    blocks, preempted, or spent its steps' time on the host is read here, not guessed."""

    SAMPLE_S = 0.05
    COUNTERS = ("num_steps", "num_pipelined_steps", "num_preemptions", "schedule_seconds_total",
                "prepare_seconds_total", "forward_seconds_total", "sample_seconds_total",
                "detokenize_seconds_total", "output_seconds_total")

    def __init__(self, engine) -> None:
        self.engine = engine
        self.samples: list[tuple[int, int, float]] = []
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.first, self.t0 = self.engine.stats(), time.perf_counter()
        self.task = asyncio.get_running_loop().create_task(self._sample())

    async def _sample(self) -> None:
        while True:
            stats = self.engine.stats()
            self.samples.append((stats.num_running, stats.num_waiting, stats.kv_cache_usage))
            await asyncio.sleep(self.SAMPLE_S)

    def stop(self) -> dict:
        self.task.cancel()
        last, seconds = self.engine.stats(), time.perf_counter() - self.t0
        added = {name: getattr(last, name) - getattr(self.first, name) for name in self.COUNTERS}
        running, waiting, kv = (np.array(column, dtype=float) for column in zip(*self.samples))
        return {**added, "wall_s": seconds,
                "mean_step_ms": 1000 * seconds / added["num_steps"] if added["num_steps"] else None,
                "mean_running": float(running.mean()), "p90_running": float(np.percentile(running, 90)),
                "max_running": int(running.max()), "max_waiting": int(waiting.max()),
                "mean_kv_cache_usage": float(kv.mean()), "max_kv_cache_usage": float(kv.max())}


def _engine_summary(side: dict) -> str:
    if side["slo_attainment"] is None or side["p99_ttft_ms"] is None:
        return "-"
    tpot = f"{side['p99_tpot_ms']:.1f}" if side["p99_tpot_ms"] is not None else "-"
    return f"{side['slo_attainment']:.1f}%, p99 TTFT {side['p99_ttft_ms']:.1f} ms, p99 TPOT {tpot} ms"


async def batch_phase(target, args, result: dict, log: StepLog) -> dict:
    """Online attainment at one rate without, then beside, a batch job in the same engine."""
    from goodserve.bench.batch_job import BatchJob, batch_input  # the server's modules: the child only

    rate, rate_from = batch_rate(args, result)
    if rate is None:
        result["saturation_rate"] = await saturated_throughput(target, args)
        rate, rate_from = result["saturation_rate"] * BATCH_RATE_FRACTION, f"{BATCH_RATE_FRACTION} x saturation"
    lines = workload(0, args, args.batch_lines, seed=BATCH_SEED)
    prompts = [target.prompt_for(line, BATCH_SEED + i) for i, line in enumerate(lines)]
    job = BatchJob(target.engine, args.model, batch_input(lines, prompts, args.model), args.batch_concurrency)
    since = time.time()
    alone = await online_probe(target, args, rate, " alone")
    steps_alone = by_path(log.take(since, time.time()))
    job.start()
    try:
        await asyncio.sleep(BATCH_RAMP_S)
        start, since = time.perf_counter(), time.time()
        beside = await online_probe(target, args, rate, " beside the batch job")
        window = job.window(start, time.perf_counter())
        finished_early = job.done
        fit_beside = step_time_report(target.engine)  # as the probe beside the job left it
        steps_beside = by_path(log.take(since, time.time()))
    finally:
        await job.stop()
    for label, steps in (("alone", steps_alone), ("beside", steps_beside)):
        print(f"steps {label}: " + "; ".join(f"{path} {s['steps']} x {s['mean_measured_ms']:.1f} ms "
                                             f"(predicted {s['mean_predicted_ms']}, {s['mean_decode_rows']:.0f} rows, "
                                             f"{s['mean_prompt_tokens']:.0f} prompt tokens, "
                                             f"{s['mean_targeted_decode_rows']:.0f} online rows)"
                                             for path, s in steps.items()), flush=True)
    drop = alone["slo_attainment"] - beside["slo_attainment"]
    print(f"batch job: {window.lines} lines, {window.as_dict()['output_tokens_per_s']:.0f} output tokens/s during "
          f"the probe; attainment {alone['slo_attainment']:.1f}% alone, {beside['slo_attainment']:.1f}% beside it "
          f"({drop:+.1f} points lost; target <= 2)", flush=True)
    return {"request_rate": rate, "rate_from": rate_from, "lines": args.batch_lines,
            "concurrency": args.batch_concurrency, "ramp_s": BATCH_RAMP_S, "alone": alone, "beside_batch": beside,
            "attainment_drop_points": drop, "within_2_points": drop <= 2.0,
            "batch_during_probe": window.as_dict(), "job_finished_during_probe": finished_early,
            "step_time_fit": fit_beside, "steps_by_path_alone": steps_alone, "steps_by_path_beside": steps_beside}


class StepLog:
    """The engine's steps as its --step-trace file records them (engine/core/step_trace.py, written in
    whichever process runs the engine): per step its shape, whether it replayed a CUDA graph, the
    fit's prediction before it and the measured time, the queue. Taken probe by probe, by wall time;
    the rows taken are what --step-log writes (FIELDS, one tuple a step)."""

    FIELDS = ("t", "decode_rows", "prompt_tokens", "context_tokens", "predicted_s", "measured_s", "graph",
              "ran_ahead", "running", "waiting", "prefill_cap", "targeted_decode_rows")

    def __init__(self, path: str) -> None:
        self.path = path
        self.rows: list[tuple] = []
        self.marks: list[int] = []  # where each probe's steps begin in rows

    def take(self, since: float, until: float) -> list[dict]:
        from goodserve.engine.core.step_trace import read_step_trace

        steps = read_step_trace(self.path, since, until)
        self.marks.append(len(self.rows))
        self.rows += [tuple(step[name] for name in self.FIELDS) for step in steps]
        return steps


STEP_SIZES = (64, 128, 256, 384, 512, 768, 1024)  # by_size's bins: decode rows up to each


def by_size(steps: list[dict]) -> dict:
    """Per bin of decode rows: steps, mean shape, mean measured and predicted ms, and the mean of
    measured / predicted: where the fit's straight line leaves the card's steps."""
    bins: dict[int, list] = {}
    for step in steps:
        bins.setdefault(next((s for s in STEP_SIZES if step["decode_rows"] <= s), 1 << 30), []).append(step)
    return {f"<={size}": {**_step_means(group),
                          "mean_measured_over_predicted": _mean(s["measured_s"] / s["predicted_s"]
                                                                for s in group if s["predicted_s"])}
            for size, group in sorted(bins.items())}


def by_path(steps: list[dict]) -> dict:
    """Per path (a decode step's CUDA graph, a mixed step's, eager): steps, mean shape, mean predicted
    and measured ms, and the median of measured / predicted."""
    paths: dict[str, list] = {}
    for step in steps:
        path = "eager" if not step["graph"] else "mixed graph" if step["prompt_tokens"] else "decode graph"
        paths.setdefault(path, []).append(step)
    report = {}
    for path, group in sorted(paths.items()):
        ratios = sorted(s["measured_s"] / s["predicted_s"] for s in group if s["predicted_s"])
        report[path] = {**_step_means(group),
                        "mean_targeted_decode_rows": _mean(s["targeted_decode_rows"] for s in group),
                        "median_measured_over_predicted": ratios[len(ratios) // 2] if ratios else None}
    return report


def _step_means(steps: list[dict]) -> dict:
    predicted = [s["predicted_s"] for s in steps if s["predicted_s"]]
    return {"steps": len(steps), "mean_decode_rows": _mean(s["decode_rows"] for s in steps),
            "mean_prompt_tokens": _mean(s["prompt_tokens"] for s in steps),
            "mean_context_tokens": _mean(s["context_tokens"] for s in steps),
            "mean_measured_ms": _mean(s["measured_s"] * 1e3 for s in steps),
            "mean_predicted_ms": _mean(p * 1e3 for p in predicted) if predicted else None}


def _mean(values) -> float:
    values = list(values)
    return round(sum(values) / len(values), 3) if values else 0.0


def step_time_report(engine) -> dict:
    """The engine's step-time fit (engine/core/step_time_model.py) as of its last step, and how far off its
    predictions ran lately (the EWMA of |measured - predicted| / predicted the slo policy's margin reads)."""
    fit = engine.forecast().fit
    report = {} if fit is None else {"a_s": fit.a, "b_s_per_decode_row": fit.b, "c_s_per_prefill_token": fit.c,
                                     "d_s_per_context_token": fit.d}
    return {**report, "relative_error": engine.stats().step_time_relative_error}


def batch_rate(args, result: dict) -> tuple[float | None, str]:
    """--batch-rate, else the highest rate this run's slo ladder passed; None: neither."""
    if args.batch_rate is not None:
        return args.batch_rate, "--batch-rate"
    passed = [p["request_rate"] for p in result.get("probes", [])
              if p["slo_attainment"] >= TARGET_ATTAINMENT * 100]
    return (max(passed), "the highest rung the slo ladder passed") if passed else (None, "")


async def saturated_throughput(target, args) -> float:
    """Requests completed per second while the batch is full: --saturation-prompts sent at once, the
    rate between their 10th and 60th percentile completions (not the whole run: its tail is one long
    answer decoding alone)."""
    records = await BenchRun(target, workload(0, args, args.saturation_prompts), ArrivalConfig()).run()
    ends = sorted(r.end_time for r in records if r.success)
    i, j = len(ends) // 10, len(ends) * 6 // 10
    rate = (j - i) / (ends[j] - ends[i]) if j > i and ends[j] > ends[i] else 1.0
    print(f"saturated throughput: {rate:.1f} req/s", flush=True)
    return rate


def crossing_rate(probes: list[dict]) -> float:
    """The offered rate where attainment falls through the target, interpolated between ladder rungs
    (a rung probed more than once counts at its mean attainment)."""
    target = TARGET_ATTAINMENT * 100
    by_rate: dict[float, list[float]] = {}
    for probe in probes:
        by_rate.setdefault(probe["request_rate"], []).append(probe["slo_attainment"])
    rungs = [(rate, sum(a) / len(a)) for rate, a in sorted(by_rate.items())]
    passing = 0.0
    for lower, (rate, attained) in zip([None, *rungs], rungs):
        if attained < target:
            if lower is None:
                return 0.0
            lower_rate, a = lower
            return lower_rate + (a - target) / (a - attained) * (rate - lower_rate)
        passing = rate
    return passing  # never fell through: at least the last rung


def run_child(policy: str, max_num_seqs: int, rates: str, args, budget_s: float) -> dict:
    """One policy at one sequence ceiling in a fresh process: its engine's memory is the GPU's again
    when it exits."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    argv = [sys.executable, os.path.abspath(__file__), "--policy", policy, "--json-out", path,
            "--model", args.model, "--device", args.device, "--rates", rates,
            "--burstiness", str(args.burstiness), "--probe-seconds", str(args.probe_seconds),
            "--min-prompts", str(args.min_prompts), "--settle-seconds", str(args.settle_seconds),
            "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--budget-s", str(budget_s), "--seed", str(args.seed), "--max-total-len", str(args.max_total_len),
            "--warmup-requests", str(args.warmup_requests), "--phases", ",".join(args.phases),
            "--arrivals", args.arrivals, "--workload", args.workload, "--batch-lines", str(args.batch_lines),
            "--batch-concurrency", str(args.batch_concurrency)] + [f for f, on in (("--step-log", args.step_log),
                                                                     ("--full-ladder", args.full_ladder),
                                                                     ("--no-admission", args.no_admission),
                                                                     ("--shed-costly", args.shed_costly),
                                                                     ("--engine-process", args.engine_process)) if on]
    if args.batch_rate is not None:
        argv += ["--batch-rate", str(args.batch_rate)]
    done = subprocess.run(argv, check=False)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {"policy": policy, "max_num_seqs": max_num_seqs,
                "error": f"the run exited with {done.returncode} and wrote no result"}
    finally:
        os.unlink(path)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.policy:
        with open(args.json_out, "w") as f:
            json.dump(asyncio.run(measure_policy(args)), f)
        return
    started = time.perf_counter()
    results = {}
    # FCFS first: under --rates auto the first sets the ladder; the batch phase runs under slo alone
    runs = [("continuous", c) for c in args.fcfs_ceilings] if "capacity" in args.phases else []
    runs.append(("slo", args.max_num_seqs))
    spent = 0.0  # probe seconds of the runs so far: what one leaves of its share goes to the next
    for i, (policy, ceiling) in enumerate(runs):
        share = max(args.budget_s - spent, 0.0) / (len(runs) - i)
        rates = args.fcfs_rates if policy == "continuous" and args.fcfs_rates else args.rates
        result = results[f"{policy}@{ceiling}"] = run_child(policy, ceiling, rates, args, share)
        spent += result.get("probes_s", share)
        if rates == args.rates:  # auto: the ladder the first run set
            args.rates = result.get("rates", args.rates)
    summary = {"model": args.model, "device": args.device, "phases": args.phases, "arrivals": args.arrivals,
               "burstiness": 1.0 if args.arrivals == "poisson" else args.burstiness, "workload": args.workload,
               "slos_ms": SLOS_MS, "target_attainment": TARGET_ATTAINMENT, "rates": args.rates,
               "fcfs_rates": args.fcfs_rates or args.rates,
               "probe_seconds": args.probe_seconds, "settle_seconds": args.settle_seconds,
               "max_num_seqs": args.max_num_seqs,
               "max_num_batched_tokens": args.max_num_batched_tokens,
               "fcfs_ceilings": args.fcfs_ceilings, "engine_process": args.engine_process, "policies": results}
    if "capacity" in args.phases:
        summarize_capacity(summary, results, f"slo@{args.max_num_seqs}")
    if "batch" in args.phases:
        summary["batch"] = results[f"slo@{args.max_num_seqs}"].get("batch")
    summary["wall_s"] = time.perf_counter() - started
    name = "gpu_slo.json" if args.phases == ["capacity"] else f"gpu_slo_{'_'.join(args.phases)}.json"
    print(f"wrote {write_result(name, summary)}")


def summarize_capacity(summary: dict, results: dict, slo: str) -> None:
    """slo's capacity against each FCFS run's: `crossing_ratio` (and `meets_1_3x`) against FCFS at slo's
    own ceiling, the fair peer, where one ran; `crossing_ratio_vs` against every FCFS ceiling."""
    caps = {run: r.get("capacity", {}).get("rate", 0.0) for run, r in results.items()}
    crossings = {run: r.get("crossing_rate", 0.0) for run, r in results.items()}
    for run in results:
        at_least = "at least " if results[run].get("crossing_is_lower_bound") else ""
        print(f"{run:>16}: goodput capacity {at_least}{crossings[run]:.2f} req/s offered "
              f"({caps[run]:.2f} by bench's capacity)")
    ratio = {run: _ratio(crossings[slo], crossings[run]) for run in results if run != slo}
    summary["crossing_ratio_vs"] = ratio
    summary["capacity_ratio_vs"] = {run: _ratio(caps[slo], caps[run]) for run in ratio}
    peer = f"continuous@{slo.split('@')[1]}"
    if peer in ratio:
        summary["crossing_ratio"], summary["capacity_ratio"] = ratio[peer], summary["capacity_ratio_vs"][peer]
        # A peer that never fell below the target crossed at least where the ladder ended: the true
        # ratio may be lower than this one, so it cannot meet the target.
        summary["meets_1_3x"] = (ratio[peer] is not None and ratio[peer] >= 1.3
                                 and not results[peer].get("crossing_is_lower_bound"))
    for run in ratio:
        print(f"{slo} / {run}: {_times(ratio[run])} ({_times(summary['capacity_ratio_vs'][run])} by bench's capacity; "
              f"target 1.3x{' at the same ceiling' if run == peer else ''})")


def _ratio(rate: float, peer_rate: float) -> float | None:
    """None where either run had no rate (no probe met the target): nothing to compare."""
    return rate / peer_rate if rate and peer_rate else None


def _times(ratio: float | None) -> str:
    return "undefined" if ratio is None else f"{ratio:.2f}x"

if __name__ == "__main__":
    main()
