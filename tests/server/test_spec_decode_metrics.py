"""Speculative decoding's counters as a live `goodserve serve` on loopback serves them (vLLM's names
under goodserve:), checked against a replay of what the engine must have done, and `goodserve bench`
reporting them.

The replay is independent of the server: greedy speculation is exact, so the output is plain greedy
decoding's (computed here by the in-process float32 engine, speculation off); at each decode step
the prompt-lookup proposer sees the prompt and the output so far, and the target keeps the drafts
that match the output's next tokens, then writes one of its own. Counting that is counting drafts.
"""

from __future__ import annotations

import json

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from goodserve import SamplingParams
from goodserve.bench import command
from goodserve.bench.command import WARMUP_SEED_OFFSET
from goodserve.bench.result import load_json
from goodserve.engine.spec_decode.ngram import propose_ngram
from helpers import HTTP_TIMEOUT_S, InProcessServer
from test_bench_client import bench_args
from test_spec_decode import COPY

K, NGRAM_MIN, NGRAM_MAX, MAX_TOKENS = 4, 1, 4, 40
# --spec-policy always: neither acceptance nor cost ever pauses a sequence's proposals, so the
# replay needs no model of that policy.
SERVER_ARGS = ["--quantization", "none", "--speculative-method", "ngram", "--num-speculative-tokens", str(K),
               "--spec-policy", "always", "--max-model-len", "512", "--log-level", "warning"]
DRAFTS = "goodserve:spec_decode_num_drafts_total"
DRAFT_TOKENS = "goodserve:spec_decode_num_draft_tokens_total"
ACCEPTED = "goodserve:spec_decode_num_accepted_tokens_total"
PER_POS = "goodserve:spec_decode_num_accepted_tokens_per_pos_total"


@pytest.fixture(scope="module")
def spec_server():
    with InProcessServer(SERVER_ARGS) as server:
        yield server.url


def scrape(url: str) -> dict[str, float]:
    """Every goodserve sample; per-position counters keyed name[position]."""
    samples = {}
    for family in text_string_to_metric_families(httpx2.get(f"{url}/metrics", timeout=HTTP_TIMEOUT_S).text):
        for s in family.samples:
            samples[f"{s.name}[{s.labels['position']}]" if s.name == PER_POS else s.name] = s.value
    return samples


def replay(prompt: list[int], output: list[int], k: int) -> dict[str, float]:
    """The counters one request adds: its first token comes from the prefill, then each decode step
    verifies what the proposer offers (at most k, and no more than the request may still write)."""
    counts = {DRAFTS: 0, DRAFT_TOKENS: 0, ACCEPTED: 0, **{f"{PER_POS}[{j}]": 0 for j in range(k)}}
    written = 1
    while written < len(output):
        room = min(k, len(output) - written - 1)
        drafts = propose_ngram(prompt + output[:written], NGRAM_MIN, NGRAM_MAX, room) if room > 0 else []
        kept = 0
        while kept < len(drafts) and drafts[kept] == output[written + kept]:
            counts[f"{PER_POS}[{kept}]"] += 1
            kept += 1
        if drafts:
            counts[DRAFTS] += 1
            counts[DRAFT_TOKENS] += len(drafts)
            counts[ACCEPTED] += kept
        written += kept + 1
    return counts


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


@pytest.mark.slow  # a speculating server of its own
def test_server_counters_match_a_replay_of_the_requests(spec_server, embedded_llm):
    tokenizer = embedded_llm.tokenizer
    prompts = [tokenizer.encode(COPY), tokenizer.encode("def fibonacci(n):\n")]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reference = embedded_llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    before = scrape(spec_server)
    for prompt, ref in zip(prompts, reference):  # one at a time: each step is one request's
        body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}
        answer = httpx2.post(f"{spec_server}/v1/completions", json=body, timeout=120).json()
        assert answer["choices"][0]["text"] == ref.outputs[0].text  # exact: plain greedy decoding's
    after = scrape(spec_server)
    expected: dict[str, float] = {}
    for prompt, ref in zip(prompts, reference):
        for name, count in replay(prompt, list(ref.outputs[0].token_ids), K).items():
            expected[name] = expected.get(name, 0) + count
    assert expected[ACCEPTED] > 10 and expected[DRAFTS] > 5  # the copy prompt's drafts are kept
    assert {name: _delta(before, after, name) for name in expected} == expected
    # Each step of a lone request writes its own token plus the drafts it kept.
    steps = _delta(before, after, "goodserve:engine_steps_total")
    assert _delta(before, after, "goodserve:generation_tokens_total") - steps == expected[ACCEPTED]


def test_no_counters_without_speculation():
    from goodserve.engine.frontend.async_engine import AsyncEngine
    from goodserve.config import EngineConfig
    from goodserve.server.metrics import ServerMetrics, Slo

    engine = AsyncEngine(EngineConfig(model="dummy:tiny", num_kv_blocks=16))
    assert b"spec_decode" not in ServerMetrics(engine, "m", Slo()).render()


@pytest.mark.slow  # a bench run; the fast tier checks the server's counters (test above)
def test_bench_reports_the_runs_speculation(spec_server, tmp_path, capsys):
    """The bench's numbers are the server's counters over the run (its warm-up left out), and the
    rates derive from them."""
    args = ["--base-url", spec_server, "--model", "smollm2-135m", "--tokenizer", "smollm2-135m",
            "--dataset-name", "copy", "--random-input-len", "96", "--random-output-len", "24", "--ignore-eos",
            "--max-concurrency", "1"]
    # The warm-up request alone: what --num-warmups 1 adds (its prompt is drawn with the run's seed
    # plus WARMUP_SEED_OFFSET).
    warm_up = tmp_path / "warm_up.json"
    before = scrape(spec_server)
    assert command.run_command(bench_args(*args, "--seed", str(3 + WARMUP_SEED_OFFSET), "--num-prompts", "1",
                                          "--result-filename", str(warm_up))) == 0
    middle = scrape(spec_server)
    out, html = tmp_path / "run.json", tmp_path / "run.html"
    assert command.run_command(bench_args(*args, "--seed", "3", "--num-prompts", "3", "--num-warmups", "1",
                                          "--result-filename", str(out), "--save-html", str(html))) == 0
    after = scrape(spec_server)
    first, result = load_json(warm_up), load_json(out)
    assert first["spec_decode_num_drafts"] == _delta(before, middle, DRAFTS)  # greedy: the same counts twice
    counted = {key: _delta(middle, after, name) - first[key] for key, name in [
        ("spec_decode_num_drafts", DRAFTS), ("spec_decode_draft_tokens", DRAFT_TOKENS),
        ("spec_decode_accepted_tokens", ACCEPTED)]}
    assert {key: result[key] for key in counted} == counted and counted["spec_decode_accepted_tokens"] > 0
    drafts, accepted = counted["spec_decode_num_drafts"], counted["spec_decode_accepted_tokens"]
    assert result["spec_decode_acceptance_rate"] == pytest.approx(100 * accepted / counted["spec_decode_draft_tokens"])
    assert result["spec_decode_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    rates = result["spec_decode_per_position_acceptance_rates"]
    assert len(rates) == K and rates == sorted(rates, reverse=True)  # kept drafts are a prefix
    assert sum(rates) * drafts == pytest.approx(accepted)
    assert result["prompt_lookup_overlap"] > 0.5  # the answers repeat (their own tokens, mostly)
    console = capsys.readouterr().out
    assert "Draft acceptance rate (%)" in console and "Per-position acceptance rate" in console
    assert "spec_decode_acceptance_length" in html.read_text()
    json.dumps(result)  # plain JSON types
