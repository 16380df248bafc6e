"""`goodserve diagnose`: the roofline of a model on a GPU, what a measured run achieved against it,
and ranked advice. Model, dtypes and hardware come from the engine configuration a goodserve bench
result (or a live goodserve /metrics) recorded; flags apply where none is recorded.

    goodserve diagnose --result result.json
    goodserve diagnose --model llama-3.1-8b --hardware h100-sxm --dtype bf16    # limits only
    goodserve diagnose --measure --metrics-url http://127.0.0.1:8000/metrics
    goodserve diagnose --model llama-3.1-70b --hardware h100-sxm --tensor-parallel-size 4
    goodserve diagnose --step-trace steps.jsonl --slo-tpot-ms 50    # a serve --step-trace file alone

With a parallel layout the roofline is one replica's: TP multiplies its FLOP/s and bandwidth, TP x
PP its memory, and a run measured through a router over DP replicas counts 1 / DP of the requests
in flight per replica. With pipeline micro-batches (the run's engine config, else the flag, else
the engine's default on that hardware) decode also gets the bandwidth and FLOP/s of the stages in
flight, min(PP, requests in flight), each micro-batch reading the weights. The all-reduces' cost
per decode token is shown beside the decode ceiling.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from goodserve.console import make_console
from goodserve.diagnose.advisor import HIGH_TPOT_S, Advice, advise
from goodserve.diagnose.assumptions import DEFAULT_HARDWARE, DEFAULT_MODEL, Assumptions, resolve
from goodserve.diagnose.calc import decode_weight_bytes, weight_bytes, window_saving
from goodserve.diagnose.model_shape import resolve_spec
from goodserve.diagnose.observations import Observations, from_bench_result, from_metrics_url
from goodserve.diagnose.parallel import (ALLREDUCE_LATENCY_S, Layout, add_layout_arguments, allreduce_payload_bytes,
                                         analyze_replica, check_layout, decode_limit, dtype_for_activations,
                                         replica_hardware)
from goodserve.diagnose.roofline import PhaseAnalysis, flops_per_token
from goodserve.diagnose.speculation import SpeculationAdvice, recommend_speculation
from goodserve.diagnose.steps import StepsReport, advise_steps, analyze_steps
from goodserve.errors import InvalidRequestError
from goodserve.hardware import HARDWARE, Hardware, get_hardware, measure_local
from goodserve.model.spec import ModelSpec

DTYPES = ("bf16", "fp16", "fp32", "int8", "int4")
KV_DTYPES = ("bf16", "fp16", "fp32", "int8", "fp8")


def register(subparsers) -> None:
    p = subparsers.add_parser("diagnose", help="roofline, MFU/MBU per phase, and advice",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="preset name, dummy:<preset>, .gguf file or HF directory (shapes only) "
                                   f"(default: the run's engine, else {DEFAULT_MODEL})")
    p.add_argument("--hardware", help=f"one of {', '.join(HARDWARE)} "
                                      f"(default: the run's device, else {DEFAULT_HARDWARE})")
    p.add_argument("--measure", action="store_true", help="probe this machine's bandwidth and matmul rate")
    p.add_argument("--dtype", choices=DTYPES,
                   help="weight dtype (default: the run's engine; else fp32 on --hardware cpu, bf16 on a GPU)")
    p.add_argument("--kv-cache-dtype", choices=KV_DTYPES,
                   help="KV cache dtype (default: the run's engine, else the compute dtype)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--result", help="a goodserve bench result JSON")
    source.add_argument("--metrics-url", help="a live goodserve server's /metrics URL")
    add_layout_arguments(p, "the measured run", "the run's engine config, else the engine's on --hardware: "
                                                "on for cpu, off on a GPU")
    p.add_argument("--step-trace", help="a step trace `serve --step-trace FILE` wrote: which steps outlast the TPOT "
                                        "target, why, and the flag values that fit them within it")
    p.add_argument("--slo-tpot-ms", type=float,
                   help=f"the TPOT target --step-trace holds steps against (default: the run's, else "
                        f"{1000 * HIGH_TPOT_S:g})")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between /metrics scrapes")
    p.add_argument("--json", dest="json_path", help="also write the diagnosis as JSON")
    p.set_defaults(func=run_command)


def model_table(spec: ModelSpec, hw: Hardware, dtype: str, compute_dtype: str, layout: Layout = Layout(),
                kv_dtype: str = "bf16") -> Table:
    """hw: one GPU; a TP x PP replica's rows are per GPU (weights) or the replica's (ceilings)."""
    weights = weight_bytes(spec, dtype)
    # At the ridge's batches a step reads every expert of a mixture: the bytes of batch -> infinity.
    read_at_ridge = decode_weight_bytes(spec, dtype, math.inf)
    group = replica_hardware(hw, layout)
    ridge = group.ridge_point(compute_dtype)
    limit = decode_limit(spec, hw, layout, 0, 1, dtype, kv_dtype)
    table = Table(title=f"{spec.name} on {group.name}" + (f", {layout.dp} replicas" if layout.dp > 1 else ""),
                  show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    rows = [
        ("parameters", f"{spec.num_params() / 1e9:.3f} B"
         + (f", {spec.num_active_params() / 1e9:.3f} B active per token ({spec.num_experts_per_tok} of "
            f"{spec.num_experts} experts)" if spec.is_moe else "")),
        (f"weights ({dtype})", f"{weights / 1e9:.2f} GB"
         + (f", {weights / (layout.tp * layout.pp) / 1e9:.2f} GB per GPU" if layout.tp * layout.pp > 1 else "")),
        ("FLOPs per token (short context)", f"{flops_per_token(spec, 0) / 1e9:.2f} GFLOP"),
        # 3 significant digits: a CPU's 0.0123 TFLOP/s and 9.8 GB/s must not print as 0.0
        (f"peak compute ({compute_dtype})", f"{group.flops_for(compute_dtype) / 1e12:.3g} TFLOP/s"),
        ("peak bandwidth", f"{group.memory_bandwidth / 1e9:.3g} GB/s"),
        ("bandwidth a copy reaches", f"{group.copy_bandwidth / 1e9:.3g} GB/s"
         + ("" if hw.copy_efficiency == 1 else f" ({100 * hw.copy_efficiency:.1f}% of peak)")),
        ("memory", f"{group.memory_bytes / 1e9:.0f} GB"),
        ("ridge point", f"{ridge:.0f} FLOP/byte"),
        ("weights a batch-1 decode step reads", f"{decode_weight_bytes(spec, dtype) / 1e9:.2f} GB"
         + ("" if spec.tie_word_embeddings else " (not the embedding table: one row of it)")),
        # One sequence: every step reads those weights, so bandwidth caps tokens/s at bw / their bytes
        # (at the copy's: the rate a step's reads get; MBU above weighs them against the peak).
        ("batch-1 decode ceiling (reads at the copy's bandwidth)", f"{limit.bandwidth_tokens_per_s:.0f} tok/s"),
        ("decode batch to reach the ridge", f"~{ridge * read_at_ridge / (2 * spec.num_matmul_params()):.0f}"),
    ]
    if spec.layer_windows and spec.max_position_embeddings:
        rows.append((f"KV of a {spec.max_position_embeddings}-token sequence ({kv_dtype}, sliding windows)",
                     window_saving(spec, spec.max_position_embeddings, kv_dtype)))
    if layout.tp > 1:
        payload = allreduce_payload_bytes(spec, layout.tp, 1, 1, dtype_for_activations(dtype))
        rows += [(f"all-reduces per decode token (TP {layout.tp})",
                  f"{2 * spec.num_layers} x {payload / (2 * spec.num_layers) / 1024:.0f} KiB, "
                  f"{1000 * limit.allreduce_s:.2f} ms at {ALLREDUCE_LATENCY_S * 1e6:.1f} us each"),
                 ("batch-1 decode expected with them and the layers' latencies", f"{limit.tokens_per_s:.0f} tok/s")]
    if layout.pp > 1:
        rows.append(("pipeline micro-batches", micro_batches_note(layout)))
    for row in rows:
        table.add_row(*row)
    return table


def micro_batches_note(layout: Layout) -> str:
    """What the stages of a PP layout add to the ceilings above (one stage's worth, at batch 1)."""
    if not layout.micro_batches:
        return "off: the stages take turns on each step"
    return (f"on: from {layout.pp} requests in flight the {layout.pp} stages decode at once ({layout.pp}x the "
            f"compute and bandwidth above), each micro-batch reading the weights")


def phases_table(phases: list[PhaseAnalysis]) -> Table:
    table = Table(title="measured against the roofline")
    for column in ("phase", "TFLOP/s", "GB/s", "MFU", "MBU", "FLOP/B", "ridge", "verdict"):
        table.add_column(column, justify="left" if column in ("phase", "verdict") else "right")
    for p in phases:
        table.add_row(p.phase, f"{p.flops_per_s / 1e12:.3f}", f"{p.bytes_per_s / 1e9:.1f}",
                      f"{100 * p.mfu:.1f}%", f"{100 * p.mbu:.1f}%", f"{p.intensity:.1f}",
                      f"{p.ridge_point:.0f}", f"[bold]{p.verdict}[/bold]")
    return table


def print_advice(console: Console, advice: list[Advice]) -> None:
    if not advice:
        console.print("[green]No symptom found: latencies within limits, no preemptions.[/green]")
        return
    for rank, item in enumerate(advice, start=1):
        console.print(f"\n[bold]{rank}. {item.symptom}[/bold]  ({item.evidence})")
        if not item.fixes:
            console.print("   every fix for this is already on or beyond this hardware")
        for fix in item.fixes:
            console.print(f"   - [cyan]{fix.option}[/cyan]: {fix.effect}\n     confirm: {fix.confirm}")


def print_speculation(console: Console, advice: SpeculationAdvice) -> None:
    verdict = "keep" if advice.keeps else "use"
    console.print(f"\n[bold]speculative decoding:[/bold] {verdict} [cyan]{advice.option}[/cyan] ({advice.why})")


def observations_of(args) -> Observations | None:
    if args.result:
        return from_bench_result(args.result)
    if args.metrics_url:
        return from_metrics_url(args.metrics_url, args.interval)
    return None


def print_assumptions(console: Console, a: Assumptions, measured: bool) -> None:
    for warning in a.warnings:
        console.print(f"[yellow]warning: {warning}[/yellow]")
    origin = f"the engine config in {a.source}" if a.engine else "flags and defaults"
    console.print(f"assuming (from {origin}): model {a.model}, weights {a.weight_dtype}, compute {a.compute_dtype}, "
                  f"KV cache {a.kv_dtype}, hardware {'measured here' if measured else a.hardware}")


def run_command(args) -> int:
    console = make_console()
    obs = observations_of(args)
    # a step trace alone has no model to put on a roofline
    report = {} if args.step_trace and obs is None and not args.model else diagnose_run(console, args, obs)
    if args.step_trace:
        report["steps"] = diagnose_steps(console, args.step_trace, tpot_target_ms(args.slo_tpot_ms, obs))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return 0


def diagnose_run(console: Console, args, obs: Observations | None) -> dict:
    """The model on the hardware's roofline and, with a measured run, the run against it and advice."""
    flags = {"model": args.model, "hardware": args.hardware, "dtype": args.dtype,
             "kv_cache_dtype": args.kv_cache_dtype, "pipeline_micro_batches": args.micro_batches}
    assumed = resolve(flags, obs.engine if obs else None, obs.source if obs else "")
    print_assumptions(console, assumed, args.measure)
    spec = resolve_spec(assumed.model)
    layout = Layout(args.tp, args.pp, args.dp, assumed.micro_batches)
    check_layout(spec, layout)
    hw = measure_local() if args.measure else get_hardware(assumed.hardware)
    console.print(model_table(spec, hw, assumed.weight_dtype, assumed.compute_dtype, layout, assumed.kv_dtype))
    report: dict = {"model": spec.name, "hardware": asdict(hw), "assumptions": asdict(assumed),
                    "layout": asdict(layout)}
    if obs is not None:
        phases = analyze_replica(spec, hw, obs, layout, assumed.weight_dtype, assumed.kv_dtype, assumed.compute_dtype)
        console.print(f"measured: {obs.source}: {obs.output_throughput:.1f} output tok/s, "
                      f"~{obs.concurrency:.1f} requests in flight, TTFT {1000 * obs.ttft_s:.0f} ms, "
                      f"TPOT {1000 * obs.tpot_s:.1f} ms")
        console.print(phases_table(phases))
        for p in phases:
            console.print(f"  {p.phase}: {p.why}")
        advice = advise(obs, phases, assumed.engine)
        print_advice(console, advice)
        speculation = recommend_speculation(obs)
        print_speculation(console, speculation)
        report.update(observations=asdict(obs), phases=[asdict(p) for p in phases],
                      advice=[asdict(a) for a in advice], speculation=asdict(speculation))
    return report


def tpot_target_ms(flag: float | None, obs: Observations | None) -> float:
    if flag is not None:
        if flag <= 0:
            raise InvalidRequestError(f"--slo-tpot-ms must be positive, got {flag:g}")
        return flag
    return ((obs.slos_ms if obs else None) or {}).get("tpot") or 1000 * HIGH_TPOT_S


def diagnose_steps(console: Console, path: str, target_ms: float) -> dict:
    report = analyze_steps(path, target_ms)
    console.print(steps_table(report))
    advice = advise_steps(report)
    if advice:
        print_advice(console, advice)
    else:
        console.print(f"[green]The steps fit the {target_ms:g} ms TPOT target.[/green]")
    return {**asdict(report), "fit": asdict(report.fit) if report.fit else None,
            "advice": [asdict(a) for a in advice]}


def steps_table(r: StepsReport) -> Table:
    table = Table(title=f"steps against a {r.target_ms:g} ms TPOT target", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    fit = r.fit
    rows = [
        ("steps", f"{r.steps} over {r.seconds:.1f} s"),
        ("step time p50 / p90 / p99 / max", f"{r.p50_ms:.1f} / {r.p90_ms:.1f} / {r.p99_ms:.1f} / {r.max_ms:.1f} ms"),
        ("steps over the target", f"{r.over_target} ({100 * r.tokens_over_target:.1f}% of the decode tokens): "
                                  f"{r.over_by_batch} by their decode rows, {r.over_by_prompts} by prompt tokens"),
        ("steps replaying a CUDA graph", f"{100 * r.graph_share:.0f}%"
         + (f", {100 * r.ran_ahead_share:.0f}% of them launched ahead" if r.graph_share else "")),
        ("the engine's predictions off by (median)",
         "no fit yet" if r.prediction_error is None else f"{100 * r.prediction_error:.1f}%"),
        ("the steps' fit", "too few shapes" if fit is None else
         f"{1000 * fit.a:.2f} ms + {1e6 * fit.b:.1f} us a decode row + {1e6 * fit.c:.1f} us a prompt token + "
         f"{1e9 * fit.d:.1f} ns a context token"),
    ]
    for row in rows:
        table.add_row(*row)
    return table
