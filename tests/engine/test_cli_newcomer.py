"""The command line for a newcomer: every --help states defaults, generate ends with a summary
line, tables piped to a file keep their full text, eval shows progress."""

import os
import re
import subprocess
import sys

import pytest

from goodserve.bench.metrics import compute_metrics
from goodserve.bench.records import RequestRecord
from goodserve.bench.result import build_result, save_json
from goodserve.cli import build_parser, main

SUBCOMMANDS = [["generate"], ["serve"], ["bench"], ["bench", "serve"], ["diagnose"], ["calc", "kv"], ["calc", "fit"],
               ["calc", "cost"], ["eval"], ["quantize"], ["router"], ["tune"]]


def goodserve(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI as a user runs it, output piped (not a terminal)."""
    return subprocess.run([sys.executable, "-m", "goodserve.cli", *argv], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


@pytest.mark.parametrize("argv", SUBCOMMANDS, ids=" ".join)
def test_every_help_shows_defaults(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    text = capsys.readouterr().out
    assert "(default:" in text
    # An option with a default that is not an on/off switch states it, e.g. --max-tokens / --port.
    expected = {"generate": "--max-tokens MAX_TOKENS", "serve": "--port PORT", "bench": "--num-prompts NUM_PROMPTS",
                "diagnose": "--interval INTERVAL", "kv": "--seq-len SEQ_LEN", "fit": "--tensor-parallel-size TP",
                "cost": "--num-gpus NUM_GPUS", "eval": "--window WINDOW", "quantize": "--device DEVICE",
                "router": "--port PORT", "tune": "--num-prompts NUM_PROMPTS"}
    option = expected[argv[-1] if argv[-1] != "serve" or len(argv) == 1 else "bench"]
    help_of_option = text.split("\n  " + option, 1)[1].split("\n  -", 1)[0]
    assert "(default:" in help_of_option, help_of_option


def test_help_never_prints_an_api_key_from_the_environment():
    for argv in (["bench", "--help"], ["serve", "--help"]):
        out = goodserve(*argv, env={"OPENAI_API_KEY": "sk-secret-1", "GOODSERVE_API_KEY": "sk-secret-2"}).stdout
        assert "(default:" in out and "sk-secret" not in out


def test_generate_ends_with_a_summary_line_on_stderr(embedded_llm, capsys):
    from goodserve import SamplingParams

    expected = embedded_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6))
    assert main(["generate", "--prompt", "The capital of France is", "--max-tokens", "6",
                 "--cpu-kv-cache-bytes", str(64 << 20)]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected[0].outputs[0].text + "\n"  # stdout keeps only the text
    num_tokens = len(expected[0].outputs[0].token_ids)
    assert re.fullmatch(rf"{num_tokens} tokens, TTFT \d+ ms, [\d.]+ tok/s decode, [\d.]+ s total\n", captured.err)


def test_a_table_piped_to_a_file_keeps_its_full_text(tmp_path):
    record = RequestRecord(0, 100, 4, 0.0, 0.1, [0.1, 0.2, 0.3, 0.4], 0.4, 4, "usage", 0, True)
    long_name = "a_result_file_whose_name_is_far_longer_than_eighty_columns_of_a_terminal_" + "x" * 40
    paths = [tmp_path / f"{long_name}_{side}.json" for side in "ab"]
    for path in paths:
        save_json(build_result({}, compute_metrics([record]), [record]), path)
    out_file = tmp_path / "compare.txt"
    with out_file.open("w") as out:
        subprocess.run([sys.executable, "-m", "goodserve.cli", "bench", "compare", *map(str, paths)], stdout=out,
                       check=True, timeout=120)
    text = out_file.read_text()
    assert f"A: {paths[0]}" in text and f"B: {paths[1]}" in text  # column headers, uncut
    assert "…" not in text


@pytest.mark.slow
def test_eval_reports_progress_when_piped(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n")
    done = goodserve("eval", "--max-text-tokens", "64", "--window", "32", "--prompts-file", str(prompts),
                     "--max-new-tokens", "2", "--cpu-kv-cache-bytes", str(32 << 20), env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    for stage in ("baseline: loading the engine 1/1", "baseline: text windows 2/2", "candidate: greedy prompts 1/1"):
        assert any(line.startswith(f"eval: {stage} (") for line in lines), done.stderr
