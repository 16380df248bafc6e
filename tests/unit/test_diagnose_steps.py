"""`goodserve diagnose --step-trace` (diagnose/steps.py) on traces whose steps follow a known line
(5 ms + 0.05 ms a decode row + 0.02 ms a prompt token): the steps over the target counted and put
down to their cause by hand, the flag values worked out from the line, the CLI's errors."""

from __future__ import annotations

import json

import pytest

from goodserve.cli import main
from goodserve.diagnose.steps import analyze_steps
from goodserve.errors import InvalidRequestError

A_MS, B_MS, C_MS = 5.0, 0.05, 0.02
TARGET_MS = 40.0
DECODE_ROWS = list(range(100, 900, 20))  # over 40 ms from 720 rows: 720..880, 9 steps
MIXED_ROWS, PROMPTS = 200, list(range(200, 2001, 100))  # 15 ms + 0.02 p: over 40 ms from 1300 tokens, 8 steps


def step(t: float, rows: int, prompt: int, graph: bool = True, ran_ahead: bool = True) -> dict:
    seconds = (A_MS + B_MS * rows + C_MS * prompt) / 1000
    return {"t": t, "decode_rows": rows, "prompt_tokens": prompt, "context_tokens": 0, "predicted_s": seconds,
            "measured_s": seconds, "graph": graph, "ran_ahead": ran_ahead, "running": rows, "waiting": 0,
            "prefill_cap": None, "targeted_decode_rows": rows}


def write_trace(path, steps: list[dict]) -> str:
    path.write_text("".join(json.dumps(s) + "\n" for s in steps))
    return str(path)


def trace(tmp_path, decode_rows=DECODE_ROWS, prompts=PROMPTS, ran_ahead: bool = True, gap_s: float = 0.06) -> str:
    """The mixed steps between the first decode steps (step 2k + 1 the k-th), one every gap_s seconds:
    the prompts' 20,900 tokens over 36 x gap_s seconds."""
    decodes, mixed = [(rows, 0) for rows in decode_rows], [(MIXED_ROWS, p) for p in prompts]
    shapes = [shape for pair in zip(decodes, mixed) for shape in pair]
    shapes += decodes[len(mixed):] + mixed[len(decodes):]
    return write_trace(tmp_path / "steps.jsonl", [step(gap_s * i, rows, prompt, ran_ahead=ran_ahead)
                                                  for i, (rows, prompt) in enumerate(shapes)])


def test_steps_over_the_target_by_cause_and_the_values_that_fit_it(tmp_path):
    report = analyze_steps(trace(tmp_path), TARGET_MS)
    assert report.steps == len(DECODE_ROWS) + len(PROMPTS)
    assert report.over_by_batch == 9 and report.over_by_prompts == 8 and report.over_target == 17
    over_rows = sum(range(720, 900, 20)) + 8 * MIXED_ROWS
    assert report.tokens_over_target == pytest.approx(over_rows / (sum(DECODE_ROWS) + MIXED_ROWS * len(PROMPTS)))
    assert (1000 * report.fit.a, 1000 * report.fit.b, 1000 * report.fit.c) == pytest.approx((A_MS, B_MS, C_MS))
    assert report.max_rows_within == 700  # (40 - 5) / 0.05
    assert report.max_batched_tokens_within == 200 + 1250  # the rows, and (40 - 5 - 0.05 x 200) / 0.02 prompt tokens
    assert report.prompt_tokens_per_s == pytest.approx(sum(PROMPTS) / (36 * 0.06))
    assert report.prediction_error == pytest.approx(0.0, abs=1e-6)
    assert report.max_ms == pytest.approx(A_MS + B_MS * MIXED_ROWS + C_MS * 2000)


def test_the_cause_with_more_steps_comes_first_with_its_flag(tmp_path, capsys):
    path = trace(tmp_path, prompts=PROMPTS[:-3])  # 5 steps over by prompts against 9 by the batch
    assert main(["diagnose", "--step-trace", path, "--slo-tpot-ms", str(TARGET_MS)]) == 0
    out = capsys.readouterr().out
    assert out.index("the running batch is too large") < out.index("--max-num-seqs 700")
    assert "--max-num-batched-tokens" not in out
    path = trace(tmp_path, decode_rows=DECODE_ROWS[:-5])  # 4 by the batch against 8 by prompts
    assert main(["diagnose", "--step-trace", path, "--slo-tpot-ms", str(TARGET_MS)]) == 0
    out = capsys.readouterr().out
    assert "prompt chunks mixed into decode steps" in out and "--max-num-batched-tokens 1450" in out
    assert "--max-num-seqs" not in out and "--scheduler-policy slo" in out


def test_no_step_budget_that_would_starve_the_prompts(tmp_path, capsys):
    """Prompts 3x as often: a budget of 1450 leaves them too little at the largest batches (on an H200,
    963 took FCFS from 85% to 20.5% attainment), so fewer sequences: the rows a step holds within 40 ms
    beside its share of the prompts' rate (2e-5 s a token x 29,028 tokens/s)."""
    path = trace(tmp_path, decode_rows=DECODE_ROWS[:-5], gap_s=0.02)
    report = analyze_steps(path, TARGET_MS)
    assert report.prompt_tokens_per_s == pytest.approx(sum(PROMPTS) / (36 * 0.02))
    assert report.prompt_room_per_s < report.prompt_tokens_per_s
    rows = int((TARGET_MS * (1 - C_MS / 1000 * report.prompt_tokens_per_s) - A_MS) / B_MS)
    assert rows == 235 and report.max_rows_beside_prompts == rows
    assert main(["diagnose", "--step-trace", path, "--slo-tpot-ms", str(TARGET_MS)]) == 0
    out = capsys.readouterr().out
    assert "prefill would fall behind" in out and "--max-num-seqs 235" in out and "--max-num-batched-tokens" not in out
    # prompts so often that their share of a step alone outlasts the target: no batch size fits, the card is full
    path = trace(tmp_path, decode_rows=DECODE_ROWS[:10], gap_s=0.005)
    assert analyze_steps(path, TARGET_MS).max_rows_beside_prompts == 0
    assert main(["diagnose", "--step-trace", path, "--slo-tpot-ms", str(TARGET_MS)]) == 0
    out = capsys.readouterr().out
    assert "at its capacity" in out and "--data-parallel-size" in out and "--max-num-seqs" not in out


def test_a_trace_of_the_slo_policy_gets_no_advice_to_run_it(tmp_path, capsys):
    steps = [json.loads(line) for line in open(trace(tmp_path))]
    path = write_trace(tmp_path / "slo.jsonl", [{**s, "prefill_cap": 2048} for s in steps])
    assert analyze_steps(path, TARGET_MS).slo_policy and not analyze_steps(trace(tmp_path), TARGET_MS).slo_policy
    assert main(["diagnose", "--step-trace", path, "--slo-tpot-ms", str(TARGET_MS)]) == 0
    out = capsys.readouterr().out
    assert "--max-num-seqs 700" in out and "--scheduler-policy slo" not in out


def test_steps_within_the_target_and_steps_that_wait_on_the_host(tmp_path, capsys):
    path = trace(tmp_path, decode_rows=DECODE_ROWS[:20], prompts=PROMPTS[:5])
    assert main(["diagnose", "--step-trace", path, "--slo-tpot-ms", str(TARGET_MS), "--json",
                 str(tmp_path / "d.json")]) == 0
    assert "The steps fit the 40 ms TPOT target" in capsys.readouterr().out
    saved = json.loads((tmp_path / "d.json").read_text())["steps"]
    assert saved["over_target"] == 0 and saved["advice"] == [] and saved["fit"]["a"] == pytest.approx(A_MS / 1000)
    path = trace(tmp_path, decode_rows=DECODE_ROWS[:20], prompts=PROMPTS[:5], ran_ahead=False)
    assert main(["diagnose", "--step-trace", path, "--slo-tpot-ms", str(TARGET_MS)]) == 0
    assert "steps wait on the host" in capsys.readouterr().out


def test_a_trace_it_cannot_read_is_a_clear_error(tmp_path, capsys):
    assert main(["diagnose", "--step-trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read the step trace" in capsys.readouterr().err
    with pytest.raises(InvalidRequestError, match="holds no steps"):
        analyze_steps(write_trace(tmp_path / "empty.jsonl", []), TARGET_MS)
    (tmp_path / "not.jsonl").write_text("{\"t\": 1}\nnot json\n")
    with pytest.raises(InvalidRequestError, match="cannot read"):
        analyze_steps(str(tmp_path / "not.jsonl"), TARGET_MS)
    assert main(["diagnose", "--step-trace", trace(tmp_path), "--slo-tpot-ms", "0"]) == 2
    assert "--slo-tpot-ms must be positive" in capsys.readouterr().err
