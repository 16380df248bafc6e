"""`goodserve tune`: the optimization loop, run for you on your workload, SLOs, hardware and
quality budget. From the configuration the engine flags give (the defaults, unless told), it
diagnoses what limits goodput, takes the step the roofline predicts helps most, gates its quality
against the unoptimized model, measures its goodput capacity, keeps it if capacity rose and
quality held, and repeats until nothing predicted to help is left or the budget is spent.

    goodserve tune --model smollm2-135m --workload sharegpt --slo-ttft-ms 500 --slo-tpot-ms 100
    goodserve tune --model dummy:llama-3.1-8b --workload sharegpt --slo-ttft-ms 200 --slo-tpot-ms 50 \\
        --gpu-hourly-cost 2.5 --budget-minutes 10

Writes to --output-dir: trials.jsonl (the log an interrupted tune resumes from), tune.json (every
trial, every step skipped and why), serve-config.json (for `goodserve serve --config`), tune.html.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from goodserve.bench.capacity import DEFAULT_MAX_PROBE_PROMPTS
from goodserve.console import make_console
from goodserve.engine_args import add_engine_arguments, engine_config_from_args
from goodserve.errors import InvalidRequestError
from goodserve.model_names import DUMMY_PREFIX
from goodserve.tune.workload import ALIASES, PROFILES, bench_workload_argv

DEFAULT_OUTPUT_DIR = "tune-out"


def register(subparsers) -> None:
    p = subparsers.add_parser("tune", help="find the configuration with the most goodput on your workload and SLOs",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what to tune for")
    g.add_argument("--workload", default="sharegpt",
                   help=f"a profile ({', '.join([*PROFILES, *ALIASES])}), a ShareGPT .json or a .jsonl of prompts, "
                        "or a recording of real traffic (goodserve serve --record-requests)")
    g.add_argument("--slo-ttft-ms", type=float, required=True, help="time-to-first-token target")
    g.add_argument("--slo-tpot-ms", type=float, required=True, help="time-per-output-token target")
    g.add_argument("--quality-budget", nargs="+", metavar="NAME:VALUE", default=[],
                   help="limits on the loss against the unoptimized model: perplexity:0.02 (at most 2%% above), "
                        "top1:0.95, greedy:0.8 (least agreement) (default: eval's limits for what each "
                        "candidate changes)")
    g.add_argument("--gpu-hourly-cost", type=float, help="$ per GPU-hour: each configuration's cost per 1M tokens")
    g.add_argument("--budget-minutes", type=float, default=30.0, help="stop starting trials past this; a trial running then ends its "
                   "capacity search with the rates probed so far")
    g.add_argument("--max-trials", type=int, help="stop after this many trials (the start included)")
    g.add_argument("--try", dest="try_options", action="append", default=[], metavar="OPTION=VALUE",
                   help="a step to measure first, before the roofline's picks (repeatable), e.g. quantization=int4")
    g = p.add_argument_group("measurement")
    g.add_argument("--num-prompts", type=int, default=100, help="requests per capacity probe")
    g.add_argument("--input-len", type=int, help="prompt tokens, for the profiles that take a length")
    g.add_argument("--output-len", type=int, help="output tokens per request (default: the workload's)")
    g.add_argument("--capacity-bisections", type=int, default=3,
                   help="probes between the last passing and first failing rate of each capacity search")
    g.add_argument("--capacity-max-prompts", type=int, default=DEFAULT_MAX_PROBE_PROMPTS,
                   help="most requests a probe sends: each after a search's first runs 4 times the p90 latency "
                        "its passing probes saw (at least --num-prompts), so it reaches a steady state")
    g.add_argument("--quality-prompts", type=int, default=8,
                   help="greedy-agreement prompts, the workload's own first ones")
    g.add_argument("--quality-text", help="perplexity text file (default: Python's pydoc_data.topics)")
    g.add_argument("--quality-text-tokens", type=int, default=2048, help="perplexity text tokens scored")
    g.add_argument("--quality-window", type=int, default=256, help="tokens per perplexity window")
    g.add_argument("--quality-new-tokens", type=int, default=32, help="greedy tokens per prompt")
    g.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR, help="trial log, JSON, serve config and HTML report")
    g.add_argument("--no-progress", action="store_true", help="no progress bars for each probe")
    add_engine_arguments(p)
    p.set_defaults(func=run)


def parse_budget(items: list[str]) -> dict[str, float]:
    from goodserve.tune.measure import BUDGET_NAMES

    budget = {}
    for item in items:
        name, sep, value = item.partition(":")
        try:
            budget[name] = float(value)
        except ValueError:
            budget[name] = None
        if not sep or name not in BUDGET_NAMES or budget[name] is None or budget[name] < 0:
            raise InvalidRequestError(f"--quality-budget {item!r}: expected NAME:VALUE with NAME one of "
                                      f"{', '.join(BUDGET_NAMES)} and VALUE a number >= 0")
    return budget


def parse_try(item: str) -> dict:
    """OPTION=VALUE -> {option: typed value}, typed and checked as the engine flag would be."""
    name, sep, value = item.partition("=")
    dest = name.strip().replace("-", "_")
    parser = argparse.ArgumentParser(prog="goodserve tune --try", add_help=False)
    add_engine_arguments(parser)
    flag = "--" + dest.replace("_", "-")
    if not sep or flag not in parser._option_string_actions:
        raise InvalidRequestError(f"--try {item!r}: expected OPTION=VALUE with OPTION an engine option, e.g. "
                                  f"quantization=int4")
    if value.lower() in ("true", "false"):
        argv = [flag if value.lower() == "true" else "--no-" + flag[2:]]
    else:
        argv = [flag, value]
    return {dest: getattr(parser.parse_args(argv), dest)}


def _check(args) -> None:
    if args.slo_ttft_ms <= 0 or args.slo_tpot_ms <= 0:
        raise InvalidRequestError("--slo-ttft-ms and --slo-tpot-ms must be positive")
    if args.budget_minutes <= 0 or (args.max_trials is not None and args.max_trials < 1):
        raise InvalidRequestError("--budget-minutes must be positive and --max-trials at least 1")
    if min(args.num_prompts, args.capacity_max_prompts, args.quality_prompts) < 1 or args.capacity_bisections < 0:
        raise InvalidRequestError("--num-prompts, --capacity-max-prompts and --quality-prompts must be at least 1, "
                                  "--capacity-bisections >= 0")


def run(args) -> int:
    from goodserve.tune.measure import options_of

    _check(args)
    budget = parse_budget(args.quality_budget)
    forced = [parse_try(item) for item in args.try_options]
    start = engine_config_from_args(args)
    workload_argv = bench_workload_argv(args.workload, args.input_len, args.output_len)
    settings = {"model": start.model, "workload": args.workload, "workload_flags": workload_argv,
                "slos_ms": {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}, "quality_budget": budget,
                "num_prompts": args.num_prompts, "capacity_max_prompts": args.capacity_max_prompts,
                "seed": start.seed, "gpu_hourly_cost": args.gpu_hourly_cost,
                "start": options_of(start), "quality": [args.quality_prompts, args.quality_text,
                                                        args.quality_text_tokens, args.quality_new_tokens]}
    return tune(args, start, settings, forced, budget)


def tune(args, start, settings: dict, forced: list[dict], budget: dict[str, float]) -> int:
    from goodserve.tune.bottleneck import diagnose_trial
    from goodserve.tune.measure import QualityGate, TrialRunner, bench_args, options_of, quality_settings
    from goodserve.tune.report import print_outcome, write_outputs
    from goodserve.tune.search import Budget, Search
    from goodserve.tune.trial_log import TrialLog

    console = make_console()
    bench = bench_args(start.model, settings["workload_flags"], settings["slos_ms"], args.num_prompts, start.seed,
                       args.gpu_hourly_cost, not args.no_progress)
    bench.capacity_max_prompts = args.capacity_max_prompts
    prompts = [] if start.model.startswith(DUMMY_PREFIX) else _workload_prompts(bench, args.quality_prompts)
    gate = QualityGate(start, quality_settings(prompts, args.quality_text, args.quality_text_tokens,
                                               args.quality_new_tokens, args.quality_window), budget)
    out_dir = Path(args.output_dir)
    log = TrialLog(out_dir / "trials.jsonl", settings)
    num_gpus = _gpu_count()
    quality_note = None if gate.enabled else f"{start.model}: quality gate off (random weights cannot be judged)"
    if quality_note:
        console.print(f"[yellow]{quality_note}[/yellow]")
    time_left = Budget(args.budget_minutes * 60)
    runner = TrialRunner(gate, bench, console, args.capacity_bisections, engine_process=num_gpus > 0
                         and start.device != "cpu", out_of_time=lambda: time_left.left() <= 0)
    runner.start_rate = max((t.get("capacity") or 0.0 for t in log.trials.values()), default=0.0) or None  # resuming
    search = Search(runner, lambda trial: diagnose_trial(trial, settings["slos_ms"], num_gpus), log,
                    time_left, args.max_trials, forced, console.print)
    outcome = search.run(options_of(start))
    if outcome.best.get("capacity") is None:
        console.print(f"[red]{outcome.stop_reason}[/red]")
        return 1
    print_outcome(outcome, console, quality_note)
    paths = write_outputs(outcome, out_dir, settings)
    console.print(f"written: {', '.join(str(p) for p in paths.values())}, and the trial log {log.path}")
    return 0


def _workload_prompts(bench_args: argparse.Namespace, count: int) -> list[str]:
    """The workload's own first prompts, as bench would send them (none without a tokenizer: a dummy model)."""
    from goodserve.bench.command import workload_config
    from goodserve.bench.text import PromptText
    from goodserve.bench.tokenizer import load_bench_tokenizer
    from goodserve.bench.workloads import build_workload

    tokenizer = load_bench_tokenizer(bench_args.model)
    if tokenizer is None:
        return []
    config = dataclasses.replace(workload_config(bench_args), num_prompts=count)
    return [r.completion_prompt() for r in build_workload(config, PromptText(tokenizer, bench_args.seed))]


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
