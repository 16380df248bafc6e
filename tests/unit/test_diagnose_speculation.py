"""`goodserve diagnose` recommends a speculative decoding method from the workload, and bench measures
the prompt-lookup overlap it reads, on hand-made inputs."""

import json

import pytest

from goodserve.bench.metrics import compute_metrics
from goodserve.bench.records import RequestRecord
from goodserve.bench.result import build_result, save_json
from goodserve.bench.spec_decode import prompt_lookup_hits, prompt_lookup_overlap
from goodserve.bench.tokenizer import load_bench_tokenizer
from goodserve.diagnose.observations import from_bench_result, observations_from_scrapes
from goodserve.diagnose.speculation import recommend_speculation
from test_diagnose import obs, run_diagnose


def test_prompt_lookup_hits_on_a_copied_sentence():
    # Predicting each copied word from the prompt and the copy so far: "the" (nothing before it ends in
    # "mat") and "cat" (the latest "the" is followed by "mat") are missed; "sat", "on", "the" and "mat"
    # follow earlier occurrences of "the cat", "cat sat", "sat on" and "sat on the".
    sentence = "the cat sat on the mat".split()
    assert prompt_lookup_hits(sentence, sentence) == (4, 6)
    assert prompt_lookup_hits([1, 2, 3], [7, 8, 9]) == (0, 3)
    assert prompt_lookup_hits([], [5, 5, 5, 5]) == (2, 4)  # the output's own repeats count too
    # Words without a tokenizer.
    assert prompt_lookup_overlap([("the cat sat on the mat", "the cat sat on the mat"), ("a b c", "x y z")]) == 4 / 9
    assert prompt_lookup_overlap([("a b", "")]) is None
    # Tokens with one: "londenlonden" is one word but repeats tokens.
    tokenizer = load_bench_tokenizer("smollm2-135m")
    ids = tokenizer.encode("londenlonden londenlonden", add_special_tokens=False)
    assert prompt_lookup_overlap([("x", "londenlonden londenlonden")], tokenizer) == prompt_lookup_hits(
        tokenizer.encode("x", add_special_tokens=False), ids)[0] / len(ids) > 0.3


@pytest.mark.parametrize("workload, method", [
    (dict(prompt_lookup_overlap=0.8), "ngram"),  # copy-heavy, batch 1
    (dict(prompt_lookup_overlap=0.1), "self:int4"),  # chat, batch 1
    (dict(), "self:int4"),  # nothing known about copying: a draft model works for any text
    (dict(prompt_lookup_overlap=0.9, concurrency=32.0), "off"),  # large batch, even when copying
    (dict(prompt_lookup_overlap=0.9, mean_output_len=4), "off"),  # nothing much to decode
    # The server ran prompt lookup: its measured acceptance decides, over the bench's estimate.
    (dict(prompt_lookup_overlap=0.9, spec_acceptance_rate=0.2, engine={"speculative_method": "ngram"}), "self:int4"),
    (dict(prompt_lookup_overlap=0.1, spec_acceptance_rate=0.7, engine={"speculative_method": "ngram"}), "ngram"),
])
def test_recommendation_follows_the_workload(workload, method):
    advice = recommend_speculation(obs(**workload))
    assert advice.method == method and advice.option.startswith(("--", "no "))


def test_recommendation_says_when_the_engine_already_runs_it():
    copying = dict(prompt_lookup_overlap=0.9, spec_acceptance_rate=0.8)
    assert recommend_speculation(obs(**copying, engine={"speculative_method": "ngram"})).keeps
    assert not recommend_speculation(obs(**copying, engine={"speculative_method": "none"})).keeps
    assert recommend_speculation(obs(concurrency=64.0, engine={"speculative_method": "none"})).keeps
    self_draft = {"speculative_method": "draft", "speculative_model": "self:int4"}
    assert recommend_speculation(obs(prompt_lookup_overlap=0.1, engine=self_draft)).keeps
    assert not recommend_speculation(obs(prompt_lookup_overlap=0.1, engine={"speculative_method": "ngram"})).keeps


def _record(index: int, text: str) -> RequestRecord:
    return RequestRecord(index, 100, 8, 0.0, 0.1, [0.1, 0.5], 0.5, 8, "usage", 0, True, generated_text=text)


def test_diagnose_reads_the_overlap_and_acceptance_of_a_bench_result(tmp_path, capsys):
    records = [_record(0, "a"), _record(1, "b")]
    metrics = {**compute_metrics(records), "prompt_lookup_overlap": 0.75, "spec_decode_acceptance_rate": 62.5}
    metrics["total_output_tokens"] = 64  # 32 tokens per answer
    save_json(build_result({"dataset_name": "copy", "engine_config": {"speculative_method": "ngram"}}, metrics,
                           records), tmp_path / "r.json")
    o = from_bench_result(str(tmp_path / "r.json"))
    assert o.prompt_lookup_overlap == 0.75 and o.spec_acceptance_rate == 0.625
    out = tmp_path / "d.json"
    assert run_diagnose("--model", "llama-2-7b", "--hardware", "a100-80gb", "--result", str(tmp_path / "r.json"),
                        "--json", str(out)) == 0
    assert "speculative decoding: keep --speculative-method ngram" in capsys.readouterr().out
    assert json.loads(out.read_text())["speculation"]["method"] == "ngram"


def test_live_scrapes_measure_the_acceptance():
    before = {"e2e_request_latency_seconds_count": 1, "spec_decode_num_draft_tokens_total": 100,
              "spec_decode_num_accepted_tokens_total": 50}
    after = {"e2e_request_latency_seconds_count": 5, "spec_decode_num_draft_tokens_total": 300,
             "spec_decode_num_accepted_tokens_total": 200}
    assert observations_from_scrapes(before, after, 10.0, "u").spec_acceptance_rate == pytest.approx(0.75)
    assert observations_from_scrapes({}, {"e2e_request_latency_seconds_count": 1}, 1.0, "u").spec_acceptance_rate is None
