"""diagnose's advice is valid and fits the machine: every flag value it suggests builds a config that
`goodserve serve` accepts (through serve's own parser and checks), no --max-num-seqs 0 where not even
one row fits, no replicas on a CPU, no placeholder where a measurement is missing, and the bound it
names agrees with the MFU it prints."""

from __future__ import annotations

import dataclasses
import re
import shlex

import pytest

from goodserve.cli import build_parser
from goodserve.diagnose.advisor import RULES, advise
from goodserve.diagnose.parallel import analyze_replica
from goodserve.diagnose.roofline import analyze_decode
from goodserve.diagnose.steps import StepsReport, advise_steps
from goodserve.engine_args import dataclass_from_args, engine_config_from_args
from goodserve.server import command as serve_command
from goodserve.server.app import ServerConfig
from test_diagnose import GPU, SPEC, obs

SERVE = build_parser()._subparsers._group_actions[0].choices["serve"]


def serve_tokens(option: str) -> list[str]:
    """The flags and values an option names: notes in parentheses and alternatives after " or " are
    prose; a flag that takes a value but names only a direction, "(lower)", is left out."""
    text = re.sub(r"\([^)]*\)", "", option).split(" or ")[0]
    if not text.startswith("--"):
        return []  # prose: a change to make, not a flag
    tokens, kept = shlex.split(text), []
    for i, token in enumerate(tokens):
        if not token.startswith("--"):
            continue
        action = SERVE._option_string_actions[token]
        if action.nargs == 0:
            kept.append(token)
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            kept += [token, tokens[i + 1]]
    return kept


def assert_serve_accepts(tokens: list[str]) -> None:
    args = SERVE.parse_args(tokens)
    serve_command._check(dataclass_from_args(ServerConfig, args), args)
    engine_config_from_args(args)


def steps_report(**overrides) -> StepsReport:
    values = dict(steps=100, seconds=10.0, p50_ms=80.0, p90_ms=90.0, p99_ms=95.0, max_ms=99.0, target_ms=20.0,
                  over_target=90, tokens_over_target=0.9, over_by_batch=90, over_by_prompts=0, graph_share=0.0,
                  ran_ahead_share=0.0, prediction_error=None, fit=None, max_rows_within=0,
                  max_batched_tokens_within=None, prompt_room_per_s=None, prompt_tokens_per_s=0.0,
                  max_rows_beside_prompts=None, max_decode_rows=64, slo_policy=False)
    return StepsReport(**{**values, **overrides})


def test_every_fix_with_values_builds_a_config_serve_accepts():
    options = [fix.option for rule in RULES for fix in rule.fixes]
    options += [fix.option for report in (steps_report(max_rows_within=12),
                                          steps_report(over_by_batch=0, over_by_prompts=90,
                                                       max_batched_tokens_within=512, prompt_room_per_s=1e6,
                                                       prompt_tokens_per_s=10.0))
                for advice in advise_steps(report) for fix in advice.fixes]
    checked = [tokens for tokens in map(serve_tokens, options) if tokens]
    assert len(checked) >= 15  # most fixes carry flags
    for tokens in checked:
        assert_serve_accepts(tokens)
    assert not any(re.search(r"--[a-z-]+ [NR]\b|\.\.", option) for option in options)  # no N, R or 2048..8192


@pytest.mark.parametrize("report", [
    steps_report(max_rows_within=0), steps_report(max_rows_within=None),
    steps_report(over_by_batch=0, over_by_prompts=90, max_batched_tokens_within=0, max_rows_beside_prompts=0),
])
def test_no_zero_batch_limits_when_not_even_one_row_fits(report):
    options = [fix.option for advice in advise_steps(report) for fix in advice.fixes]
    assert options and not any(re.search(r"--max-num-(seqs|batched-tokens) 0\b", o) for o in options)
    for tokens in filter(None, map(serve_tokens, options)):
        assert_serve_accepts(tokens)


def test_no_replicas_or_gpu_only_fixes_for_a_cpu_engine():
    engine = {"device": "cpu", "enable_chunked_prefill": "True", "enable_prefix_caching": "True",
              "scheduler_policy": "continuous", "quantization": "gguf", "engine_process": "True"}
    shares = {"schedule": 0.5, "prepare": 0.1, "forward": 0.1, "sample": 0.1, "detokenize": 0.1, "output": 0.1}
    o = obs(ttft_p99_s=30.0, tpot_p99_s=2.0, step_phase_shares=shares)
    options = [fix.option for advice in advise(o, analyze_replica(SPEC, GPU, o), engine) for fix in advice.fixes]
    assert options and not any("--data-parallel-size" in o or "--tensor-parallel-size" in o
                               or "--gpu-memory-utilization" in o for o in options)


def test_an_unknown_queue_is_left_out_not_printed_as_a_placeholder():
    o = obs(ttft_p99_s=30.0, num_waiting=None)
    (ttft,) = [a for a in advise(o, analyze_replica(SPEC, GPU, o)) if a.symptom == "high TTFT"]
    assert "?" not in ttft.evidence and "waiting" not in ttft.evidence
    o = dataclasses.replace(o, num_waiting=7)
    (ttft,) = [a for a in advise(o, analyze_replica(SPEC, GPU, o)) if a.symptom == "high TTFT"]
    assert "7 waiting" in ttft.evidence


def test_the_bound_named_agrees_with_the_measured_mfu():
    # 512 sequences put decode above the ridge; at 10 s a step the GPU did under 1% of its peak.
    slow = analyze_decode(SPEC, GPU, obs(concurrency=512, mean_prompt_len=10, mean_output_len=10, tpot_s=10.0))
    assert slow.intensity > slow.ridge_point and slow.mfu < 0.01
    assert slow.verdict == "overhead-bound" and f"MFU is {100 * slow.mfu:.1f}%" in slow.why
    fast = analyze_decode(SPEC, GPU, obs(concurrency=512, mean_prompt_len=10, mean_output_len=10))
    assert fast.verdict == "compute-bound" and fast.mfu > 0.1
