"""The scheduling policies on a simulated clock: the real Scheduler, KVCacheManager and admission
check, with each step's time given by a step-time model instead of a GPU.

What it isolates is the policy: which requests run when, and which are refused. Arrivals are gamma
(burstiness 0.25 by default), lengths ShareGPT-like (bench/workloads.py), every output ignore_eos;
a step of r decode rows reading k tokens of context and p prompt tokens lasts a + b r + c p + d k
seconds, times a seeded random factor uniform in 1 +- 2 x --step-error (its mean |error|: the card's
steps miss their fit by ~15%) (defaults: the H100's FCFS fit on dummy llama-3.1-8b in
results/gpu_slo_h100.json, 6.3 ms a step and 0.059 ms a decode row, with 30 us a prompt token; that fit had no context term: d = 0). Under "slo" every request carries the targets and a request the
admission check refuses (engine/frontend/admission.py) is a miss. FCFS runs at each of --fcfs-ceilings
(max_num_seqs), slo at --max-num-seqs, as benchmarks/gpu_slo.py does on the card. Prints SLO
attainment per run and rate (refusals, and the served requests that missed TTFT or TPOT), and the
goodput capacity (highest rate with attainment >= 90%) with slo's ratio to each FCFS run.

--sync-step-cost S adds S seconds of host time (schedule, launch, output processing: ~2 ms on the
H100) to each step async scheduling could not have launched ahead of the one before: one following
a step that does not sample in every row (an unfinished prompt chunk) or carries drafts, or the
first after an idle engine (engine.py's _may_run_ahead). Steps ahead hide that time behind the
device. The step-time model still sees the step alone, as the engine measures it. Approximation:
the sim decides every step as the engine decides a synchronous one; a step the engine launches
ahead continues only the previous step's rows and admits only waiting requests (scheduler.py's
_schedule_ahead), which the sim does not restrict. Each run reports the share of such steps.

A step the engine launches ahead is decided when the step before it begins, not when it ends, so a
request that arrives while a step runs joins the step after next, a step later than synchronously
(on an H200 at 69 req/s 97% of the steps launched ahead: benchmarks/BENCHMARKS.md). The sim admits
arrivals so (--no-launch-ahead-admits: as of the step's end, as the sim once did);
the slo policy's clock still reads the end of the step before.

    python benchmarks/cpu_slo_sim.py [--rates 24,28,32] [--max-num-seqs 1024 --fcfs-ceilings 256,1024]
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import numpy as np

from goodserve.bench.arrivals import ArrivalConfig, send_offsets
from goodserve.bench.text import PromptText
from goodserve.bench.workloads import WorkloadConfig, build_workload
from goodserve.config import EngineConfig
from goodserve.engine.frontend.admission import SHED_POWER, SHED_STRENGTH, SHED_WINDOW, Admission
from goodserve.engine.core.kv_cache_manager import KVCacheManager
from goodserve.engine.core.scheduler import Scheduler
from goodserve.engine.core.sequence import Sequence
from goodserve.engine.core.step_time_model import StepTimeFit, step_shape
from goodserve.errors import QueueFullError
from goodserve.sampling_params import SamplingParams
from goodserve.server.batch_lines import BATCH_PRIORITY

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_slo  # noqa: E402
from result_file import write_result  # noqa: E402



class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def probe_requests(args, rate: float) -> list:
    """--num-prompts of seed --seed; with --probe-seconds, gpu_slo.py's very requests at that rate."""
    if args.probe_seconds:
        probe = argparse.Namespace(min_prompts=1, settle_seconds=args.settle_seconds, probe_seconds=args.probe_seconds,
                                   seed=args.seed, workload=args.workload,
                                   max_total_len=4096 if args.workload == "long-prompt" else 2048)
        return gpu_slo.workload(rate, probe)
    if args.workload == "long-prompt":  # DistServe's summarisation-like shape: ~2k in, ~200 out
        config = WorkloadConfig(dataset_name="random", num_prompts=args.num_prompts, seed=args.seed,
                                random_input_len=2000, random_output_len=200)
    else:
        config = WorkloadConfig(dataset_name="sharegpt", num_prompts=args.num_prompts, seed=args.seed)
    return build_workload(config, PromptText(None, args.seed))


def simulate(policy: str, max_num_seqs: int, rate: float, args, fit: StepTimeFit) -> dict:
    clock = _Clock()
    config = EngineConfig(scheduler_policy=policy, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, block_size=16)
    sched = Scheduler(config, KVCacheManager(args.num_kv_blocks, 16))
    if policy == "slo":
        sched.policy.clock = clock
    admission = Admission(max_waiting=1 << 62, shed_costly=args.shed_costly) if policy == "slo" else None
    requests = probe_requests(args, rate)
    offsets = send_offsets(ArrivalConfig(rate, args.burstiness), len(requests), args.seed)
    scored = [offset >= args.settle_seconds for offset in offsets]  # gpu_slo.py scores these alone
    ttft_s, tpot_s = args.ttft_ms / 1000, args.tpot_ms / 1000
    next_arrival, met, refused, token = 0, 0, 0, 1
    missed = {"ttft": 0, "tpot": 0}  # of the requests served
    ttfts, tpots = [], []
    batch = build_workload(WorkloadConfig(dataset_name="sharegpt", num_prompts=args.batch_concurrency * 50,
                                          seed=args.seed + 1), PromptText(None, args.seed)) if args.batch_concurrency else []
    batch_live, batch_done, batch_tokens = 0, 0, 0
    noise = random.Random(args.seed)
    num_steps, num_sync_steps, runs_ahead = 0, 0, False  # runs_ahead: the next step may launch ahead
    step_start = 0.0  # when the step just simulated began on the device
    while next_arrival < len(requests) or any(s.params.priority != BATCH_PRIORITY for s in sched.running) \
            or any(s.params.priority != BATCH_PRIORITY for s in sched.waiting):
        # A step launched ahead was decided as the one before it began: what arrived since waits a step more.
        decided_at = step_start if runs_ahead and args.launch_ahead_admits else clock.now
        while next_arrival < len(requests) and offsets[next_arrival] <= decided_at:
            r = requests[next_arrival]
            params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, slo_ttft_ms=args.ttft_ms,
                                    slo_tpot_ms=args.tpot_ms)
            prompt = list(range(token, token + r.prompt_len))  # distinct: no prefix is shared
            token += r.prompt_len
            seq = Sequence(seq_id=str(next_arrival), request_id=str(next_arrival), index=0, token_ids=prompt,
                           num_prompt_tokens=r.prompt_len, params=params, max_len=r.prompt_len + r.output_len,
                           arrival_time=offsets[next_arrival])
            next_arrival += 1
            if admission is not None:
                try:
                    admission.check_ttft(sched.forecast(), r.prompt_len, args.ttft_ms, r.output_len)
                except QueueFullError:
                    refused += scored[next_arrival - 1]
                    continue
                admission.admit(1, r.prompt_len)
            sched.add(seq)
        while batch_live < args.batch_concurrency and batch and next_arrival < len(requests):
            r = batch.pop()
            params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, priority=BATCH_PRIORITY)
            prompt = list(range(token, token + r.prompt_len))
            token += r.prompt_len
            sched.add(Sequence(seq_id=f"batch{len(batch)}", request_id=f"batch{len(batch)}", index=0,
                               token_ids=prompt, num_prompt_tokens=r.prompt_len, params=params,
                               max_len=r.prompt_len + r.output_len, arrival_time=clock.now))
            batch_live += 1
        out = sched.schedule()
        if not out:
            clock.now, runs_ahead = offsets[next_arrival], False
            continue
        shape = step_shape(out)
        seconds = fit.seconds(*shape) * (1 + noise.uniform(-2, 2) * args.step_error)
        sched.step_time.observe(*shape, seconds)
        num_steps, num_sync_steps = num_steps + 1, num_sync_steps + (not runs_ahead)
        step_start = clock.now + (0.0 if runs_ahead else args.sync_step_cost)
        clock.now = step_start + seconds
        runs_ahead = out.all_sample and not out.draft_token_ids
        sched.advance(out)
        for seq_id, samples in zip(out.seq_ids, out.samples):
            if not samples:
                continue
            seq = sched.seqs[seq_id]
            seq.token_ids.append(0)
            if seq.params.priority == BATCH_PRIORITY:
                batch_tokens += 1
                if seq.num_tokens >= seq.max_len:
                    batch_live, batch_done = batch_live - 1, batch_done + 1
                    sched.finish(seq, "length")
                continue
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = clock.now
                if admission is not None:
                    admission.started(1, seq.num_prompt_tokens)
            if seq.num_tokens >= seq.max_len and not scored[int(seq.seq_id)]:
                sched.finish(seq, "length")
            elif seq.num_tokens >= seq.max_len:
                first = seq.metrics.first_token_time
                tpot = (clock.now - first) / max(seq.num_output_tokens - 1, 1)
                ttfts.append(first - seq.arrival_time)
                tpots.append(tpot)
                ttft_met = first - seq.arrival_time <= ttft_s
                tpot_met = seq.num_output_tokens < 2 or tpot <= tpot_s
                met += ttft_met and tpot_met
                missed["ttft"] += not ttft_met
                missed["tpot"] += not tpot_met
                sched.finish(seq, "length")
    return {"policy": policy, "max_num_seqs": max_num_seqs, "request_rate": rate, "slo_attainment": 100.0 * met / sum(scored),
            "refused_429": refused, "missed_ttft": missed["ttft"], "missed_tpot": missed["tpot"], "duration_s": clock.now, "num_preemptions": sched.num_preemptions,
            "median_tpot_ms": _percentile_ms(tpots, 50), "p90_tpot_ms": _percentile_ms(tpots, 90),
            "p99_tpot_ms": _percentile_ms(tpots, 99), "p99_ttft_ms": _percentile_ms(ttfts, 99),
            "batch_lines_done": batch_done, "batch_output_tok_s": batch_tokens / clock.now if clock.now else 0.0,
            "sync_step_share": num_sync_steps / num_steps if num_steps else 0.0}


def _percentile_ms(seconds: list[float], q: float) -> float:
    return 1000 * float(np.percentile(seconds, q)) if seconds else 0.0


def capacity(runs: list[dict], target: float = 90.0) -> float:
    passing = [run["request_rate"] for run in runs if run["slo_attainment"] >= target]
    return max(passing, default=0.0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="8,12,16,20,24,28,32,40")
    p.add_argument("--workload", choices=("sharegpt", "long-prompt"), default="sharegpt")
    p.add_argument("--burstiness", type=float, default=0.25)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--probe-seconds", type=float,
                   help="each rate's requests and arrivals those of gpu_slo.py's probe of this length at that rate "
                        "(its workload seed and count), in place of --num-prompts, to set beside the card's probes")
    p.add_argument("--settle-seconds", type=float, default=0.0,
                   help="with --probe-seconds: gpu_slo.py's --settle-seconds, arrivals this much longer, and only the "
                        "requests sent after it scored")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-ms", type=float, default=200.0)
    p.add_argument("--tpot-ms", type=float, default=50.0)
    p.add_argument("--step", default="0.0063,0.000059,0.00003", help="a,b,c[,d] of the step time, seconds")
    p.add_argument("--step-error", type=float, default=0.0,
                   help="the steps' mean relative error against the fit (each step times 1 + U(-2, 2) x this)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="the slo run's sequence ceiling")
    p.add_argument("--fcfs-ceilings", help="comma-separated max_num_seqs of the FCFS runs (default: --max-num-seqs)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--batch-concurrency", type=int, default=0,
                   help="a batch job beside the online requests: this many lines in the engine at all times")
    p.add_argument("--sync-step-cost", type=float, default=0.0,
                   help="seconds of host time added to each step that could not launch ahead (see above)")
    p.add_argument("--num-kv-blocks", type=int, default=30000)
    p.add_argument("--shed-costly", action="store_true",
                   help="slo: the admission check sheds the costliest requests first (engine/frontend/admission.py)")
    p.add_argument("--launch-ahead-admits", action=argparse.BooleanOptionalAction, default=True,
                   help="a step that launches ahead admits what arrived by the start of the step before (see above)")
    args = p.parse_args(argv)
    fit = StepTimeFit(*(float(x) for x in args.step.split(",")))
    ceilings = [int(c) for c in (args.fcfs_ceilings or str(args.max_num_seqs)).split(",")]
    labels = {f"continuous@{c}": ("continuous", c) for c in ceilings}
    labels[slo := f"slo@{args.max_num_seqs}"] = ("slo", args.max_num_seqs)
    runs = {label: [] for label in labels}
    for rate in (float(r) for r in args.rates.split(",")):
        for label, (policy, ceiling) in labels.items():
            run = simulate(policy, ceiling, rate, args, fit)
            runs[label].append(run)
            print(f"{label:>16} {rate:6.1f} req/s: attainment {run['slo_attainment']:5.1f}% "
                  f"refused {run['refused_429']:4d} missed TTFT {run['missed_ttft']:4d} TPOT {run['missed_tpot']:4d} preemptions {run['num_preemptions']} "
                  f"TPOT p50/p90/p99 {run['median_tpot_ms']:.1f}/{run['p90_tpot_ms']:.1f}/{run['p99_tpot_ms']:.1f} ms "
                  f"p99 TTFT {run['p99_ttft_ms']:.0f} ms batch {run['batch_output_tok_s']:.0f} tok/s "
                  f"sync steps {100 * run['sync_step_share']:.0f}%", flush=True)
    caps = {label: capacity(r) for label, r in runs.items()}
    ratios = {label: caps[slo] / cap if cap else 0.0 for label, cap in caps.items() if label != slo}
    print(f"capacity: {caps}; {slo} / " + ", ".join(f"{label} {r:.2f}x" for label, r in ratios.items()))
    shed = {"strength": SHED_STRENGTH, "power": SHED_POWER, "window": SHED_WINDOW} if args.shed_costly else None
    write_result("cpu_slo_sim.json", {"args": vars(args), "shed": shed, "runs": runs, "capacity": caps,
                                      "slo_ratio_vs": ratios})


if __name__ == "__main__":
    main()
