"""`goodserve eval`: the quality gate on the command line. Exit status 0 = pass, 1 = fail."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from goodserve.console import stage_progress
from goodserve.engine_args import add_engine_arguments


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="quality gate: compare an engine configuration against the unoptimized one",
        description="Run the same model twice, unoptimized and as configured by the engine flags "
                    "(e.g. --quantization int8, --kv-cache-dtype int8, --no-prefix-caching), and compare "
                    "perplexity, top-1 next-token agreement and greedy agreement against thresholds. "
                    "With --speculative-method the candidate must also agree exactly (1.000) with "
                    "itself without speculation.",
    )
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help="same as --no-enable-prefix-caching")
    work = parser.add_argument_group("workload")
    work.add_argument("--text-file", help="perplexity text (default: Python's pydoc_data.topics)")
    work.add_argument("--max-text-tokens", type=int, default=4096, help="text tokens scored (default: 4096)")
    work.add_argument("--window", type=int, default=256, help="tokens per perplexity window (default: 256)")
    work.add_argument("--prompts-file", help="greedy prompts, one per line (default: a built-in set of 16)")
    work.add_argument("--max-new-tokens", type=int, default=32, help="greedy tokens per prompt (default: 32)")
    limits = parser.add_argument_group("thresholds (defaults depend on what the configuration changes)")
    limits.add_argument("--max-perplexity-increase", type=float, help="relative, e.g. 0.01 for 1%%")
    limits.add_argument("--min-top1-agreement", type=float)
    limits.add_argument("--min-greedy-agreement", type=float)
    parser.add_argument("--output", help="write the JSON report here")
    parser.add_argument("--json", action="store_true", help="print the JSON report instead of a summary")
    add_engine_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from goodserve.commands.quality_gate import EvalSettings, default_thresholds, evaluate
    from goodserve.engine.frontend.preflight import checked_engine_config
    from goodserve.engine.setup.config_resolution import resolve_for_device

    settings = EvalSettings(text_file=args.text_file, max_text_tokens=args.max_text_tokens, window=args.window,
                            max_new_tokens=args.max_new_tokens)
    if args.prompts_file:
        settings.prompts = _read_prompts(args.prompts_file)
    settings.validate()
    config = checked_engine_config(args)
    thresholds = default_thresholds(resolve_for_device(config))  # the dtype and quantization it will run
    for name in ("max_perplexity_increase", "min_top1_agreement", "min_greedy_agreement"):
        if getattr(args, name) is not None:
            setattr(thresholds, name, getattr(args, name))
    with stage_progress("eval") as on_progress:
        report = evaluate(config, settings, thresholds, on_progress)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2) if args.json else summary(report))
    return 0 if report["passed"] else 1


def _read_prompts(path: str) -> list[str]:
    from goodserve.errors import InvalidRequestError

    if not Path(path).is_file():
        raise InvalidRequestError(f"prompts file {path} does not exist")
    prompts = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise InvalidRequestError(f"prompts file {path} has no prompts")
    return prompts


def _check_lines(rows: list[dict]) -> list[str]:
    return [f"  {'PASS' if row['passed'] else 'FAIL'}  {row['metric']:<20} {row['value']:.4f} {row['op']} "
            f"{row['limit']:.4f}" for row in rows]


def _speculation_summary(spec: dict) -> list[str]:
    m = spec["metrics"]
    rate = "-" if spec["acceptance_rate"] is None else f"{spec['acceptance_rate']:.3f}"
    return [f"speculation ({spec['method']}) against the {spec['reference']}: greedy agreement "
            f"{m['greedy_agreement']:.3f}, perplexity {m['baseline_perplexity']:.4f} -> "
            f"{m['candidate_perplexity']:.4f}; {spec['accepted_tokens']} of {spec['draft_tokens']} "
            f"draft tokens kept (acceptance {rate})", *_check_lines(spec["checks"])]


def summary(report: dict) -> str:
    m = report["metrics"]
    changes = ", ".join(f"{k}={v}" for k, v in report["differs_from_baseline"].items()) or "nothing"
    lines = [
        f"model {report['model']}; candidate changes: {changes}",
        f"text: {report['text']['source']}, {report['text']['scored_tokens']} tokens scored; "
        f"greedy: {report['greedy']['prompts']} prompts x {report['greedy']['max_new_tokens']} tokens",
        f"perplexity: baseline {m['baseline_perplexity']:.4f}, candidate {m['candidate_perplexity']:.4f}",
    ]
    lines += _check_lines(report["checks"])
    lines.append(f"greedy exact match {m['greedy_exact_match']:.3f}, "
                 f"mean |logprob diff| {m['mean_abs_logprob_diff']:.5f}")
    if "speculation" in report:
        lines += _speculation_summary(report["speculation"])
    lines.append("PASSED" if report["passed"] else "FAILED")
    return "\n".join(lines)
