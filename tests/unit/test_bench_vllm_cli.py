"""`vllm bench serve` command lines, copied from vLLM's documentation, run by `goodserve bench` as
they are: each parses, its flags map as vLLM maps them, its dataset loads offline (a local ShareGPT
file, the bundled sonnets, a local Hugging Face rows file); flags goodserve does not have are refused
with what to use instead; one line runs end to end against a loopback server, whose result file has
vLLM's keys (the list below is what vLLM's serve.py writes)."""

from __future__ import annotations

import json
import shlex

import pytest

from goodserve.bench import command
from goodserve.bench.text import PromptText
from goodserve.bench.workloads import build_workload
from goodserve.cli import build_parser, main
from goodserve.errors import InvalidRequestError
from test_bench_client import SseServer

# From docs.vllm.ai's benchmarking pages (vllm bench serve ...); {paths} are filled with local files.
VLLM_LINES = [
    "--backend vllm --model NousResearch/Hermes-3-Llama-3.1-8B --endpoint /v1/completions "
    "--dataset-name sharegpt --dataset-path {sharegpt} --num-prompts 10",
    "--model meta-llama/Llama-2-7b-chat-hf --dataset-name sonnet --dataset-path {sonnet} --num-prompts 10 "
    "--sonnet-input-len 200 --sonnet-prefix-len 50 --sonnet-output-len 20",
    "--backend openai-chat --model Qwen/Qwen2-VL-7B-Instruct --endpoint /v1/chat/completions "
    "--dataset-name hf --dataset-path {hf} --hf-split train --num-prompts 10",
    "--model meta-llama/Llama-3.1-8B-Instruct --dataset-name hf --dataset-path {hf} --num-prompts 10 "
    "--hf-output-len 64",
    "--model meta-llama/Llama-3.1-8B-Instruct --dataset-name custom --dataset-path {custom} "
    "--custom-skip-chat-template --num-prompts 8 --max-concurrency 1 --temperature=0.3 --top-p=0.75 "
    "--result-dir ./log/",
    "--backend vllm --model meta-llama/Llama-3.1-8B-Instruct --dataset-name random --random-input-len 1024 "
    "--random-output-len 128 --random-range-ratio 0.1 --num-prompts 10 --request-rate 5 --burstiness 0.5 "
    "--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --goodput ttft:500 tpot:50",
    "--model meta-llama/Llama-3.1-8B-Instruct --dataset-name prefix_repetition --num-prompts 10 "
    "--prefix-repetition-prefix-len 512 --prefix-repetition-suffix-len 128 --prefix-repetition-num-prefixes 5 "
    "--prefix-repetition-output-len 128",
    "--backend vllm --model meta-llama/Llama-3.1-8B-Instruct --served-model-name llama --input-len 64 "
    "--output-len 32 --num-prompts 10 --ignore-eos --save-result --save-detailed --label nightly "
    "--metadata version=0.11 tp=1 --seed 42 --disable-tqdm --trust-remote-code",
]

# The keys `vllm bench serve --save-result --save-detailed` writes for a generation run with --goodput
# and the default percentile metrics (vllm/benchmarks/serve.py: main_async and benchmark()).
VLLM_RESULT_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
    "generated_texts", "errors", "max_output_tokens_per_s", "max_concurrent_requests",
    *(f"{stat}_{metric}_ms" for stat in ("mean", "median", "std", "p99") for metric in ("ttft", "tpot", "itl")),
}


@pytest.fixture
def files(tmp_path):
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([{"conversations": [
        {"from": "human", "value": f"question number {i} about the weather in a city"},
        {"from": "gpt", "value": f"answer number {i} says it is sunny and warm today"}]} for i in range(5)]))
    sonnet = tmp_path / "sonnet.txt"
    sonnet.write_text("".join(f"line {i} of a poem about the sea and the sky\n" for i in range(40)))
    hf = tmp_path / "rows.jsonl"
    hf.write_text("".join(json.dumps({"instruction": f"write a function number {i}", "output": "def f(): pass"})
                          + "\n" for i in range(6)))
    custom = tmp_path / "custom.jsonl"
    custom.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(4)))
    return {"sharegpt": sharegpt, "sonnet": sonnet, "hf": hf, "custom": custom}


def parsed(line: str):
    args = build_parser().parse_args(command.with_default_action(["bench", *shlex.split(line)]))
    command.check_args(args)
    return args


@pytest.mark.parametrize("line", VLLM_LINES)
def test_vllm_command_lines_parse_and_their_datasets_load(line, files):
    args = parsed(line.format(**files))
    requests = build_workload(command.workload_config(args), PromptText(None, args.seed))
    assert len(requests) == args.num_prompts and all(r.prompt and r.output_len > 0 for r in requests)


def test_general_lengths_and_names_map_as_in_vllm(files):
    args = parsed(VLLM_LINES[-1])
    assert (args.backend, args.backend_name) == ("openai", "vllm")
    assert (args.random_input_len, args.random_output_len, args.sharegpt_output_len, args.hf_output_len) == (
        64, 32, 32, 32)
    assert args.metadata_pairs == {"version": "0.11", "tp": "1"}
    target = command.make_target(args, None)
    assert target.config.model == "llama"  # --served-model-name is sent; --model names the tokenizer


def test_sonnet_prompts_share_their_first_lines_and_reach_the_input_length(files):
    line = VLLM_LINES[1].format(**files)
    args = build_parser().parse_args(command.with_default_action(["bench", *shlex.split(line)]))
    requests = build_workload(command.workload_config(args), PromptText(None, 0))
    first_lines = [r.prompt.splitlines()[:4] for r in requests]
    assert all(lines == first_lines[0] for lines in first_lines)  # instruction + prefix lines: shared
    assert all(abs(r.prompt_len - 200) <= 12 for r in requests)  # lines of 11 words, rounded to whole lines
    bundled = build_workload(command.workload_config(build_parser().parse_args(
        ["bench", "serve", "--dataset-name", "sonnet", "--num-prompts", "2"])), PromptText(None, 0))
    from goodserve.bench.sonnets import SONNET_LINES

    assert set(bundled[0].prompt.splitlines()[1:]) <= {line.rstrip("\n") for line in SONNET_LINES}


@pytest.mark.parametrize("flags, instead", [
    ("--ramp-up-strategy linear --ramp-up-start-rps 1 --ramp-up-end-rps 10", "--sweep-request-rates"),
    ("--lora-modules a b", "no LoRA"),
    ("--profile", "--step-trace"),
    ("--plot-timeline", "--save-html"),
])
def test_vllm_flags_without_a_meaning_here_say_what_to_use(flags, instead, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", *shlex.split(flags)])
    assert instead in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["tgi", "openai-audio", "openai-embeddings"])
def test_backends_goodserve_cannot_measure_are_refused(backend):
    with pytest.raises(InvalidRequestError, match="use --backend openai"):
        parsed(f"--backend {backend}")


def test_an_unknown_flag_is_named_not_misread_as_an_action(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--no-such-flag", "x"])
    assert "unrecognized arguments: --no-such-flag x" in capsys.readouterr().err


def test_a_vllm_line_end_to_end_writes_vllms_keys(tmp_path, files):
    server = SseServer(mode="ok", tokens=3)
    try:
        line = (VLLM_LINES[-1] + f" --goodput ttft:60000 --result-dir {tmp_path} --result-filename run.json "
                f"--header x-team=search --base-url {server.url} --tokenizer none")
        assert main(["bench", *shlex.split(line)]) == 0
    finally:
        server.close()
    result = json.loads((tmp_path / "run.json").read_text())
    assert VLLM_RESULT_KEYS <= set(result), VLLM_RESULT_KEYS - set(result)
    assert (result["backend"], result["label"], result["version"]) == ("vllm", "nightly", "0.11")
    assert result["completed"] == 10
    assert result["errors"] == [""] * 10 and len(result["ttfts"]) == 10
    assert {body["model"] for body in server.bodies} == {"llama"} and all(b["ignore_eos"] for b in server.bodies)


def test_without_save_detailed_the_per_request_arrays_are_left_out(tmp_path):
    server = SseServer(mode="ok", tokens=2)
    try:
        assert main(["bench", "--backend", "vllm", "--base-url", server.url, "--tokenizer", "none", "--num-prompts",
                     "3", "--input-len", "4", "--output-len", "2", "--save-result", "--result-dir", str(tmp_path),
                     "--disable-tqdm"]) == 0
    finally:
        server.close()
    (path,) = tmp_path.glob("vllm-infqps-*.json")  # vLLM's file name: label (the backend), rate, model, date
    result = json.loads(path.read_text())
    assert result["completed"] == 3 and not {"ttfts", "itls", "errors", "input_lens"} & set(result)


def test_a_probe_capped_below_one_prompt_is_refused():
    with pytest.raises(InvalidRequestError, match="--capacity-max-prompts must be at least 1"):
        parsed("--backend openai --goodput ttft:200 --goodput-capacity --capacity-max-prompts 0")
