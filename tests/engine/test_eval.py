"""The quality gate: metric math against hand-computed values, perplexity against Hugging Face
transformers on the same windows, and the `goodserve eval` command end to end."""

import dataclasses
import json
import math

import pytest
import torch

from goodserve.cli import main
from goodserve.commands import quality_gate
from goodserve.config import EngineConfig
from goodserve.errors import InvalidRequestError


def test_compare_matches_hand_computed_metrics():
    base = quality_gate.RunResult(token_logprobs=[[-1.0, -2.0], [-3.0]], top1_tokens=[[5, 6], [7]],
                           greedy_tokens=[[1, 2, 3, 4], [9, 9]], seconds=0.0)
    cand = quality_gate.RunResult(token_logprobs=[[-1.5, -2.0], [-3.0]], top1_tokens=[[5, 0], [7]],
                           greedy_tokens=[[1, 2, 0, 0], [9, 9]], seconds=0.0)
    m = quality_gate.compare(base, cand)
    assert m["baseline_perplexity"] == pytest.approx(math.exp(2.0))
    assert m["candidate_perplexity"] == pytest.approx(math.exp(6.5 / 3))
    assert m["perplexity_increase"] == pytest.approx(math.exp(0.5 / 3) - 1)
    assert m["top1_agreement"] == pytest.approx(2 / 3)
    assert m["mean_abs_logprob_diff"] == pytest.approx(0.5 / 3)
    assert m["greedy_agreement"] == pytest.approx((0.5 + 1.0) / 2)
    assert m["greedy_exact_match"] == pytest.approx(0.5)
    rows = quality_gate.checks(m, quality_gate.Thresholds(0.2, 0.7, 0.5))
    assert [r["passed"] for r in rows] == [True, False, True]


def test_text_windows_and_bad_settings(tmp_path):
    assert quality_gate.text_windows(list(range(10)), 4, 9) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(InvalidRequestError, match="fewer than one"):
        quality_gate.text_windows([1, 2], 4, 100)
    with pytest.raises(InvalidRequestError, match="does not exist"):
        quality_gate.EvalSettings(text_file=str(tmp_path / "missing.txt")).validate()
    with pytest.raises(InvalidRequestError, match="window"):
        quality_gate.EvalSettings(window=1).validate()


def test_default_thresholds_add_budgets_per_lossy_change():
    exact = quality_gate.default_thresholds(EngineConfig(dtype="float32"))
    int4 = quality_gate.default_thresholds(EngineConfig(dtype="float32", quantization="int4"))
    both = quality_gate.default_thresholds(EngineConfig(dtype="float32", quantization="int4", kv_cache_dtype="int8"))
    assert exact.max_perplexity_increase < int4.max_perplexity_increase < both.max_perplexity_increase
    assert exact.min_top1_agreement > int4.min_top1_agreement > both.min_top1_agreement


def test_a_16_bit_dtype_starts_from_a_wider_rounding_floor():
    """bf16 through another attention kernel flips near-ties that float32 keeps: its exact changes
    get a looser floor, and lossy changes still subtract their budgets from it."""
    f32, bf16 = (quality_gate.default_thresholds(EngineConfig(dtype=d)) for d in ("float32", "bfloat16"))
    assert bf16.min_top1_agreement < f32.min_top1_agreement and bf16.min_greedy_agreement < f32.min_greedy_agreement
    int8 = quality_gate.default_thresholds(EngineConfig(dtype="bfloat16", quantization="int8"))
    assert int8.min_top1_agreement == pytest.approx(bf16.min_top1_agreement - 0.04)
    with pytest.raises(KeyError):  # the budget is for what the engine runs: "auto" must be resolved first
        quality_gate.default_thresholds(EngineConfig())


def test_baseline_perplexity_matches_transformers(embedded_llm, hf_embedded):
    settings = quality_gate.EvalSettings(max_text_tokens=128, window=64, prompts=["Hello"], max_new_tokens=2)
    workload = quality_gate.build_workload(embedded_llm.tokenizer, settings)
    ours = quality_gate.run_workload(embedded_llm, workload, settings.max_new_tokens)
    with torch.no_grad():
        logits = hf_embedded(torch.tensor(workload.windows)).logits.float()
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
    targets = torch.tensor(workload.windows)[:, 1:]
    hf_token_logprobs = logprobs.gather(-1, targets[..., None])[..., 0]
    hf_ppl = math.exp(-hf_token_logprobs.mean().item())
    assert quality_gate.perplexity(ours.token_logprobs) == pytest.approx(hf_ppl, rel=1e-3)
    hf_top1 = logprobs.argmax(-1).tolist()
    matches = sum(a == b for ow, hw in zip(ours.top1_tokens, hf_top1) for a, b in zip(ow, hw))
    assert matches / targets.numel() > 0.98  # near-ties may flip between two float32 implementations


@pytest.mark.slow
def test_eval_command_fails_a_configuration_over_its_threshold(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is\nOnce upon a time\n")
    report_path = tmp_path / "report.json"
    code = main(["eval", "--quantization", "int4", "--quantization-group-size", "64",
                 "--max-text-tokens", "128", "--window", "64", "--prompts-file", str(prompts),
                 "--max-new-tokens", "4", "--max-perplexity-increase", "0", "--output", str(report_path)])
    assert code == 1
    report = json.loads(report_path.read_text())
    assert report["differs_from_baseline"]["quantization"] == "int4"
    assert report["baseline"]["quantization"] == "none" and not report["passed"]  # the float path, explicitly
    m = report["metrics"]
    assert m["candidate_perplexity"] > m["baseline_perplexity"]  # 4-bit weights cost something
    assert 0.5 < m["top1_agreement"] < 1.0
    assert report["checks"][0] == {"metric": "perplexity_increase", "value": m["perplexity_increase"],
                                   "op": "<=", "limit": 0.0, "passed": False}
    assert "FAIL  perplexity_increase" in capsys.readouterr().out


# two engines; the fast tier checks the budgets (test_default_thresholds_add_budgets_per_lossy_change)
@pytest.mark.slow
def test_eval_command_budgets_for_what_the_engine_runs(tmp_path):
    """Unset, a GGUF model on the CPU runs its file's codes: eval holds it to the gguf budget on the
    resolved float32 floor, not to the budget of an exact change."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is\n")
    report_path = tmp_path / "report.json"
    main(["eval", "--device", "cpu", "--max-text-tokens", "128", "--window", "64",
          "--prompts-file", str(prompts), "--max-new-tokens", "4", "--output", str(report_path)])
    report = json.loads(report_path.read_text())
    assert report["candidate"]["quantization"] == "gguf"
    expected = quality_gate.default_thresholds(EngineConfig(dtype="float32", quantization="gguf"))
    assert report["thresholds"] == dataclasses.asdict(expected)
    assert expected.min_greedy_agreement < quality_gate.EXACT_THRESHOLDS["float32"][2]


def test_eval_command_reports_a_missing_text_file(tmp_path, capsys):
    assert main(["eval", "--text-file", str(tmp_path / "nope.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err
