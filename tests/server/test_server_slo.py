"""Per-request latency targets through the server: under the slo policy a request whose TTFT the
queue makes impossible is a 429 with Retry-After (OpenAI's error body), or, with slo_best_effort,
served at a low priority; the check itself on a hand-made forecast, and --slo-shed-costly's ranks and
refusals worked out by hand."""

from __future__ import annotations

import openai
import pytest

from goodserve.engine.frontend.admission import SHED_MIN_RANKED, Admission, CostlyRequestShed, CostRanks, TtftUnattainable
from goodserve.engine.core.forecast import Forecast
from goodserve.engine.core.step_time_model import StepTimeFit
from goodserve.errors import QueueFullError
from goodserve.cli import main
from goodserve.server.process import scrape_metrics
from helpers import HTTP_TIMEOUT_S, InProcessServer

MODEL = "dummy:tiny"  # no tokenizer: prompts are token ids


@pytest.fixture(scope="module")
def client():
    server = InProcessServer(["--model", MODEL, "--scheduler-policy", "slo", "--max-model-len", "512",
                            "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--slo-shed-costly"])
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)
        # Steps of three shapes (prompts of 3 and 200 tokens, decodes) give the step-time model a fit.
        for prompt_len in (3, 200, 3, 200):
            client.completions.create(model=MODEL, prompt=[5] * prompt_len, max_tokens=4)
        yield client, server.url
    finally:
        server.stop()


def test_impossible_ttft_is_429_with_retry_after(client):
    client, url = client
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2, extra_body={"slo_ttft_ms": 1e-6})
    response = refused.value.response
    assert int(response.headers["Retry-After"]) >= 1
    error = response.json()["error"]
    assert error["type"] == "rate_limit_exceeded" and "slo_best_effort" in error["message"]
    assert scrape_metrics(url)["goodserve:request_rejected_total{status=429}"] >= 1


def test_best_effort_and_default_targets_are_served(client):
    client, _ = client
    out = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2,
                                    extra_body={"slo_ttft_ms": 1e-6, "slo_best_effort": True, "ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    out = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2,  # the server's 60 s
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"


def test_attainment_is_scored_against_the_requests_own_targets(client):
    client, url = client
    missed = "goodserve:request_slo_total{attained=false}"
    before = scrape_metrics(url).get(missed, 0.0)
    client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3,  # an early EOS would leave no TPOT
                              extra_body={"slo_tpot_ms": 1e-6, "ignore_eos": True})
    assert scrape_metrics(url).get(missed, 0.0) == before + 1  # the server's 60 s would have been met


def test_invalid_target_is_422(client):
    client, _ = client
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model=MODEL, prompt=[5], max_tokens=1, extra_body={"slo_tpot_ms": 0})


def test_check_counts_the_prompt_tokens_waiting_ahead():
    """10 ms a step, 1 ms a decode, 0.1 ms a prompt token; 10 decodes, 250 prompt tokens a step:
    a step of 250 prompt tokens takes 45 ms."""
    forecast = Forecast(StepTimeFit(0.010, 0.001, 0.0001), decode_rows=10, prefill_tokens_per_step=250)
    admission = Admission(max_waiting=100)
    admission.check_ttft(forecast, prompt_tokens=250, ttft_ms=50)  # alone: one 45 ms step
    admission.admit(num_seqs=1, prompt_tokens=1000)  # four steps ahead of it now
    with pytest.raises(TtftUnattainable) as refused:
        admission.check_ttft(forecast, prompt_tokens=250, ttft_ms=50)
    assert isinstance(refused.value, QueueFullError)  # a 429
    assert refused.value.retry_after_s == 1  # 225 ms predicted: the queue drains within a second
    admission.check_ttft(forecast, prompt_tokens=250, ttft_ms=250)
    admission.started(num_seqs=1, prompt_tokens=1000)
    admission.check_ttft(forecast, prompt_tokens=250, ttft_ms=50)
    admission.check_ttft(Forecast(None, 10, 250), prompt_tokens=10**6, ttft_ms=1)  # no fit yet: no refusal


def test_cost_ranks_among_the_last_window():
    ranks = CostRanks(window=SHED_MIN_RANKED + 1)
    assert all(ranks.rank(float(cost)) is None for cost in range(1, SHED_MIN_RANKED + 1))  # too few ranked yet
    assert ranks.rank(32.5) == 32 / SHED_MIN_RANKED  # above 1..32 of 1..64
    assert ranks.rank(100.0) == 1.0  # the costliest so far; the window drops its oldest, cost 1
    assert ranks.sorted[0] == 2.0 and len(ranks.sorted) == SHED_MIN_RANKED + 1
    assert ranks.rank(0.5) == 0.0


def test_shedding_refuses_the_costliest_first():
    """The forecast of the test above: 45 ms to a 250-token prompt's first token, queue empty. Ranked
    among 64 requests asking 1..64 tokens, one asking 1,000 is the costliest (rank 1): it may wait
    (1 - 0.9) x its target, 10 ms of 100, and is refused; one asking none (rank 0) waits the whole 100."""
    forecast = Forecast(StepTimeFit(0.010, 0.001, 0.0001), decode_rows=10, prefill_tokens_per_step=250)
    shedding, plain = Admission(max_waiting=100, shed_costly=True), Admission(max_waiting=100)
    for admission in (shedding, plain):
        for output_tokens in range(1, SHED_MIN_RANKED + 1):
            admission.check_ttft(forecast, prompt_tokens=250, ttft_ms=1000, output_tokens=output_tokens)
    with pytest.raises(CostlyRequestShed) as refused:
        shedding.check_ttft(forecast, prompt_tokens=250, ttft_ms=100, output_tokens=1000)
    assert isinstance(refused.value, QueueFullError) and refused.value.retry_after_s == 1
    assert "costliest" in str(refused.value) and "may wait 10 ms" in str(refused.value)
    shedding.check_ttft(forecast, prompt_tokens=250, ttft_ms=100, output_tokens=0)
    plain.check_ttft(forecast, prompt_tokens=250, ttft_ms=100, output_tokens=1000)  # not shedding: admitted
    with pytest.raises(TtftUnattainable):  # past the target itself: the plain refusal, whatever the cost
        shedding.check_ttft(forecast, prompt_tokens=250, ttft_ms=40, output_tokens=0)


def test_shedding_needs_the_slo_policy(capsys):
    assert main(["serve", "--model", MODEL, "--slo-shed-costly"]) == 2
    assert "--scheduler-policy slo" in capsys.readouterr().err
