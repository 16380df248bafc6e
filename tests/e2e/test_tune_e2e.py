"""goodserve tune end to end on the CPU with the embedded model (full tier: it loads the model four
times and searches two goodput capacities). From float32 it must find the known-good choice, the
GGUF file's own codes, and reject int4 computed at load, a candidate past a 5% perplexity budget
(int4 re-rounds the file's Q4_1 codes: +27% perplexity on this model), before timing it.

One sequence at a time (--max-num-seqs 1) keeps decode at batch 1, where the GGUF kernels read 0.18x
float32's bytes (a request here took 0.15-0.21 s against 0.36-0.39 s): at larger batches on a busy
2-core machine float32's matmuls and faster prefill can win, and the test would measure the load."""

from __future__ import annotations

import argparse
import json

import pytest

from goodserve.cli import main
from goodserve.model_names import embedded_model_installed
from goodserve.server.command import register as register_serve
from goodserve.server.config_file import apply_config_file

pytestmark = pytest.mark.skipif(not embedded_model_installed(), reason="needs the embedded model")

ARGV = ["tune", "--quantization", "none", "--max-num-seqs", "1", "--workload", "random", "--input-len", "16",
        "--output-len", "8", "--num-prompts", "8", "--slo-ttft-ms", "3000", "--slo-tpot-ms", "100", "--try", "quantization=int4",
        "--quality-budget", "perplexity:0.05", "--max-trials", "3", "--budget-minutes", "10",
        "--capacity-bisections", "0", "--capacity-max-prompts", "16", "--quality-prompts", "3",
        "--quality-text-tokens", "256", "--quality-window", "128", "--quality-new-tokens", "8", "--no-progress"]


def serve_args_from(config_path) -> argparse.Namespace:
    """serve's own parser, its defaults, then the config file tune wrote."""
    parser = argparse.ArgumentParser()
    register_serve(parser.add_subparsers())
    serve = parser._subparsers._group_actions[0].choices["serve"]
    args = parser.parse_args(["serve"])
    apply_config_file(args, serve, str(config_path))
    return args


def test_tune_finds_gguf_codes_and_rejects_int4_past_the_quality_budget(tmp_path, capsys):
    out = tmp_path / "tune"
    assert main([*ARGV, "--output-dir", str(out)]) == 0
    result = json.loads((out / "tune.json").read_text())
    by_move = {t["move"]: t for t in result["trials"]}
    assert set(by_move) == {"start", "quantization=int4", "quantization=gguf"}
    int4 = by_move["quantization=int4"]
    assert int4["status"] == "rejected: quality" and int4["capacity"] is None  # never timed
    assert int4["quality"]["metrics"]["perplexity_increase"] > 0.05
    gguf = by_move["quantization=gguf"]
    assert gguf["status"] == "kept" and gguf["quality"]["passed"]
    assert gguf["capacity"] > by_move["start"]["capacity"] > 0
    assert result["winner"] == {"max_num_seqs": 1, "quantization": "gguf"}
    assert result["serve_command"] == "goodserve serve --max-num-seqs 1 --quantization gguf"
    assert [row["step"] for row in result["ranked"]] == ["quantization=gguf", "start", "quantization=int4"]
    assert "goodput capacity against quality loss" in (out / "tune.html").read_text()
    served = serve_args_from(out / "serve-config.json")
    assert (served.quantization, served.max_num_seqs) == ("gguf", 1)

    # Run again: every trial comes from the log, nothing is measured, the same winner.
    capsys.readouterr()
    assert main([*ARGV, "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("resumed from the trial log") == 3 and "engine:" not in printed
    assert json.loads((out / "tune.json").read_text())["winner"] == {"max_num_seqs": 1, "quantization": "gguf"}
