"""Workload generators and arrival processes."""

import json
import math

import numpy as np
import pytest

from goodserve.bench.arrivals import ArrivalConfig, parse_sweep, send_offsets
from goodserve.bench.text import PromptText
from goodserve.bench.workloads import DatasetError, WorkloadConfig, build_workload, sample_lengths
from goodserve.errors import InvalidRequestError

WORDS = PromptText(None)


def build(**kw):
    return build_workload(WorkloadConfig(**kw), PromptText(None, seed=kw.get("seed", 0)))


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert sample_lengths(rng, 100, 0.5, "fixed", 5) == [100] * 5
    uniform = sample_lengths(rng, 100, 0.5, "uniform", 2000)
    assert min(uniform) >= 50 and max(uniform) <= 150 and abs(np.mean(uniform) - 100) < 3
    normal = sample_lengths(rng, 100, 0.2, "normal", 4000)
    assert abs(np.mean(normal) - 100) < 2 and abs(np.std(normal) - 20) < 2
    lognormal = sample_lengths(rng, 100, 1.0, "lognormal", 4000)
    assert abs(np.median(lognormal) - 100) < 10 and np.mean(lognormal) > 140  # long right tail
    assert min(sample_lengths(rng, 2, 5.0, "normal", 1000)) >= 1
    with pytest.raises(InvalidRequestError):
        sample_lengths(rng, 100, 0.1, "zipf", 3)
    with pytest.raises(InvalidRequestError, match="must not be negative"):  # numpy's own error, unchecked
        sample_lengths(rng, 100, -0.5, "normal", 3)


def test_random_workload_lengths_and_shared_prefix():
    reqs = build(num_prompts=20, random_input_len=30, random_output_len=8, random_prefix_len=10)
    assert len(reqs) == 20
    assert all(r.prompt_len == 40 and r.output_len == 8 for r in reqs)
    assert all(WORDS.count(r.prompt) == 40 for r in reqs)
    prefixes = {" ".join(r.prompt.split()[:10]) for r in reqs}
    assert len(prefixes) == 1 and len({r.prompt for r in reqs}) == 20


def test_random_workload_with_real_tokenizer_hits_token_lengths():
    from goodserve.bench.tokenizer import load_bench_tokenizer

    tokenizer = load_bench_tokenizer("smollm2-135m")
    text = PromptText(tokenizer, seed=1)
    reqs = build_workload(WorkloadConfig(num_prompts=8, random_input_len=64, random_range_ratio=0.5), text)
    for r in reqs:
        assert abs(len(tokenizer.encode(r.prompt, add_special_tokens=False)) - r.prompt_len) <= 2


def test_prefix_repetition():
    reqs = build(dataset_name="prefix_repetition", num_prompts=12, prefix_repetition_num_prefixes=3,
                 prefix_repetition_prefix_len=20, prefix_repetition_suffix_len=5,
                 prefix_repetition_output_len=4)
    prefixes = [" ".join(r.prompt.split()[:20]) for r in reqs]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 4 for p in set(prefixes))
    assert all(r.prompt_len == 25 and WORDS.count(r.prompt) == 25 for r in reqs)


def test_multiturn_structure():
    reqs = build(dataset_name="multiturn", num_prompts=7, multiturn_num_turns=3, random_input_len=5)
    assert [(r.conversation_id, r.turn) for r in reqs] == [
        (0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (0, 2)]
    turn = reqs[3]
    turn.history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert turn.chat_messages()[-1] == {"role": "user", "content": turn.prompt}
    assert turn.completion_prompt().startswith("User: a\nAssistant: b\nUser: ")


def test_copy_workload_answer_repeats_input():
    reqs = build(dataset_name="copy", num_prompts=3, random_input_len=40, random_output_len=100)
    for r in reqs:
        instruction, passage = r.prompt.split("\n\n", 1)
        assert "Repeat" in instruction and WORDS.count(passage) == 40
        assert r.output_len == 40  # as long as the passage, not the larger --random-output-len


def test_custom_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "one two three", "output_tokens": 5}\n\n{"prompt": "four five"}\n')
    reqs = build(dataset_name="custom", dataset_path=str(path), num_prompts=5, custom_output_len=9)
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(3, 5), (2, 9), (3, 5), (2, 9), (3, 5)]


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "ok"}\n{"prompt": oops}\n', r"d.jsonl:2: not valid JSON"),
    ('{"text": "no prompt"}\n', r"d.jsonl:1: each line needs a non-empty string 'prompt'"),
    ('{"prompt": "x", "output_tokens": -1}\n', r"d.jsonl:1: 'output_tokens' must be a positive integer"),
    ("", r"no requests"),
])
def test_custom_jsonl_malformed(tmp_path, content, message):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        build(dataset_name="custom", dataset_path=str(path), num_prompts=2)


def test_missing_dataset_file(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        build(dataset_name="custom", dataset_path=str(tmp_path / "nope.jsonl"))


def test_sharegpt_file_and_filter(tmp_path):
    long_answer = " ".join(["word"] * 30)
    data = [
        {"conversations": [{"from": "human", "value": "tell me about the sea please"},
                           {"from": "gpt", "value": long_answer}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": long_answer}]},  # < 4
        {"conversations": [{"from": "human", "value": "only one turn here"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = build(dataset_name="sharegpt", dataset_path=str(path), num_prompts=3)
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(6, 30)] * 3
    path.write_text(json.dumps([{"conversations": "oops"}]))
    with pytest.raises(DatasetError, match="no 'conversations' list"):
        build(dataset_name="sharegpt", dataset_path=str(path))
    path.write_text("[{")
    with pytest.raises(DatasetError, match="not valid JSON"):
        build(dataset_name="sharegpt", dataset_path=str(path))


def test_sharegpt_synthetic_profile():
    reqs = build(dataset_name="sharegpt", num_prompts=500)
    inputs = [r.prompt_len for r in reqs]
    outputs = [r.output_len for r in reqs]
    assert min(inputs) >= 4 and max(inputs) <= 1024
    assert all(i + o <= 2048 and o >= 4 for i, o in zip(inputs, outputs))
    assert np.mean(inputs) > np.median(inputs)  # long-tailed like the real file
    assert all(WORDS.count(r.prompt) == r.prompt_len for r in reqs[:20])


def test_arrivals_poisson_gamma_constant():
    assert send_offsets(ArrivalConfig(), 4) == [0.0] * 4
    constant = send_offsets(ArrivalConfig(request_rate=4.0, constant=True), 5)
    assert constant == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    poisson = np.diff(send_offsets(ArrivalConfig(request_rate=10.0), 20001, seed=1))
    assert poisson.mean() == pytest.approx(0.1, rel=0.03)
    assert poisson.std() == pytest.approx(0.1, rel=0.05)  # exponential: std = mean
    bursty = np.diff(send_offsets(ArrivalConfig(request_rate=10.0, burstiness=0.25), 20001, seed=1))
    assert bursty.mean() == pytest.approx(0.1, rel=0.05)
    assert bursty.std() == pytest.approx(0.1 / math.sqrt(0.25), rel=0.08)  # gamma: std = mean/sqrt(k)


def test_arrival_and_sweep_validation():
    with pytest.raises(InvalidRequestError):
        send_offsets(ArrivalConfig(request_rate=0), 3)
    with pytest.raises(InvalidRequestError):
        send_offsets(ArrivalConfig(burstiness=-1), 3)
    assert parse_sweep("1, 2,inf", "--x") == [1.0, 2.0, math.inf]
    with pytest.raises(InvalidRequestError):
        parse_sweep("1,abc", "--x")
    with pytest.raises(InvalidRequestError):
        parse_sweep("0", "--x")
