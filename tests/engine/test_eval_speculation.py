"""`goodserve eval` with speculative decoding on: the candidate against itself without speculation
must agree exactly (greedy 1.000, perplexity unchanged), on the embedded model."""

import json

import pytest

from goodserve.cli import main
from goodserve.commands import quality_gate
from goodserve.config import EngineConfig

# One line each (a prompts file holds one prompt a line); the first is copied, so drafts are kept.
PROMPTS = ["Repeat this exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over "
           "the lazy dog, the quick brown fox", "def fibonacci(n):", "The capital of France is"]


@pytest.mark.slow
def test_eval_command_checks_ngram_against_the_same_engine_without_it(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    report_path = tmp_path / "report.json"
    code = main(["eval", "--quantization", "none", "--speculative-method", "ngram", "--max-text-tokens", "128",
                 "--window", "64", "--prompts-file", str(prompts), "--max-new-tokens", "32",
                 "--output", str(report_path)])
    report = json.loads(report_path.read_text())
    assert code == 0 and report["passed"]
    assert report["baseline"]["speculative_method"] is None  # the baseline decodes plainly
    spec = report["speculation"]
    # Prefix caching (on in the candidate, off in the baseline) makes a third engine the reference.
    assert spec["method"] == "ngram" and spec["reference"] == "candidate without speculation"
    m = spec["metrics"]
    assert m["greedy_agreement"] == 1.0 and m["greedy_exact_match"] == 1.0 and m["top1_agreement"] == 1.0
    assert m["candidate_perplexity"] == m["baseline_perplexity"]
    assert spec["accepted_tokens"] > 0 and [row["passed"] for row in spec["checks"]] == [True, True, True]
    assert "speculation (ngram) against the candidate without speculation: greedy agreement 1.000" in (
        capsys.readouterr().out)


@pytest.mark.slow  # two eval runs of the embedded model
def test_speculation_reuses_the_baseline_run_when_it_is_the_same_engine():
    candidate = EngineConfig(model="smollm2-135m", **{**quality_gate.BASELINE_OPTIONS, "speculative_method": "ngram"})
    settings = quality_gate.EvalSettings(max_text_tokens=64, window=64, prompts=PROMPTS[:1], max_new_tokens=24)
    report = quality_gate.evaluate(candidate, settings)
    assert report["speculation"]["reference"] == "baseline" and report["passed"]
    assert report["speculation"]["metrics"]["greedy_agreement"] == 1.0
    assert report["speculation"]["accepted_tokens"] > 0
