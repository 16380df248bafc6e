"""Goodput capacity is the offered rate of the best passing probe that held it, else the rate that
probe sustained (never more than it completed), and says when probes are noisy: synthetic probe
records, capacity computed by hand."""

import math

import pytest

from goodserve.bench.capacity import capacity_of, min_prompts_for, probe_prompts, rate_resolution
from goodserve.bench.metrics import compute_metrics
from goodserve.bench.records import RequestRecord
from goodserve.bench.report import print_report
from goodserve.bench.result import build_result

SLOS = {"ttft": 500.0}


def probe(offered_rate: float, sends: list[float], ttft: float, e2e: float | list[float]) -> dict:
    """A probe's result; e2e: every request's latency, or one per request."""
    latencies = e2e if isinstance(e2e, list) else [e2e] * len(sends)
    records = [RequestRecord(i, 10, 4, t, t + ttft, [t + ttft, t + e], t + e, 4, "usage", None, True)
               for i, (t, e) in enumerate(zip(sends, latencies))]
    metrics = compute_metrics(records, slos=SLOS, offered_rate=offered_rate)
    return build_result({"request_rate": offered_rate}, metrics, records)


def test_capacity_of_a_burst_is_what_it_completed():
    # 8 prompts offered at 256 req/s all leave at t=0 and finish at 4/3 s: 6 req/s completed.
    burst = probe(256.0, [0.0] * 8, ttft=0.1, e2e=4 / 3)
    # 8 prompts at 4 req/s: sent every 0.25 s, each done in 0.2 s: 8 / 1.95 s = 4.10 req/s completed.
    steady = probe(4.0, [i * 0.25 for i in range(8)], ttft=0.1, e2e=0.2)
    # Offered 8 req/s (sent every 0.125 s, last done at 1.575 s), every TTFT 0.6 s: misses the
    # 500 ms SLO, so it cannot count however fast.
    failing = probe(8.0, [i * 0.125 for i in range(8)], ttft=0.6, e2e=0.7)
    assert burst["request_throughput"] == pytest.approx(6.0)
    assert steady["request_throughput"] == pytest.approx(8 / 1.95)
    cap = capacity_of([steady, failing, burst], target=0.9)
    # steady held its 4 req/s: in [0.2 s (the 90th-percentile latency), 1.75 s (the last send)] 7
    # requests finished and 7 arrived. The burst never reached a steady state (none finished before
    # its last send): it sustained what it completed.
    assert steady["sustained_request_rate"] == pytest.approx(4.0) and burst["sustained_request_rate"] == 6.0
    assert cap["rate"] == pytest.approx(6.0) and not cap["held"]  # max(4, min(256, 6.0)); never 256
    assert cap["rate"] <= max(p["request_throughput"] for p in (steady, burst))
    assert cap["noisy"] and len(cap["warnings"]) == 2
    assert "8 prompts per probe" in cap["warnings"][0] and "--num-prompts 50" in cap["warnings"][0]
    assert "offered 256 req/s but sustained 6 req/s" in cap["warnings"][1]
    assert [p["request_throughput"] for p in cap["probes"]] == pytest.approx([8 / 1.95, 8 / 1.575, 6.0])
    assert [p["duration"] for p in cap["probes"]] == pytest.approx([1.95, 1.575, 4 / 3])  # what each probe took


def test_capacity_of_a_probe_that_held_its_rate_is_not_noisy():
    # 50 prompts at 2 req/s, sent every 0.5 s, each done in 0.3 s: 50 / 24.8 s = 2.016 req/s completed.
    held = probe(2.0, [i * 0.5 for i in range(50)], ttft=0.1, e2e=0.3)
    cap = capacity_of([held], target=0.9)
    assert cap["rate"] == pytest.approx(2.0) and cap["held"] and not cap["noisy"] and cap["warnings"] == []
    assert capacity_of([probe(2.0, [0.0], ttft=0.9, e2e=1.0)], 0.9)["rate"] == 0.0  # nothing passed


def test_a_probe_that_kept_up_reads_its_offered_rate_despite_its_drain():
    # 400 requests at 50 req/s (one every 20 ms, the last sent at 7.98 s), TTFT 0.1 s: every tenth a
    # long answer of 3 s, the others 0.5 s. The run lasts until 10.8 s: 37.0 req/s completed, though
    # the server kept up (latencies never grew), as a ShareGPT run's longest answers drain on a GPU.
    sends = [i * 0.02 for i in range(400)]
    kept_up = probe(50.0, sends, ttft=0.1, e2e=[3.0 if i % 10 == 0 else 0.5 for i in range(400)])
    assert kept_up["request_throughput"] == pytest.approx(400 / (sends[390] + 3.0))
    # From the 90th-percentile latency (0.75 s) to the last send, 326 short and 25 long ones finished
    # (the long ones sent after 4.98 s finish after the window) while 362 arrived.
    assert kept_up["sustained_request_rate"] == pytest.approx(50.0 * 351 / 362)
    cap = capacity_of([kept_up], target=0.9)
    assert cap["rate"] == 50.0 and cap["held"] and cap["warnings"] == []


def test_a_probe_that_fell_behind_reads_what_it_completed():
    # 400 requests offered at 50 req/s to a server finishing one every 40 ms (25 req/s): each waits
    # longer than the last, and the SLO (TTFT only) still passes. Its sustained rate is its completed
    # rate, 400 / 16.46 s: the queue grew all run, so no window of it is a steady state.
    sends = [i * 0.02 for i in range(400)]
    behind = probe(50.0, sends, ttft=0.1, e2e=[0.5 + i * 0.02 for i in range(400)])
    assert behind["sustained_request_rate"] == pytest.approx(400 / (0.5 + 399 * 0.04))
    cap = capacity_of([behind], target=0.9)
    assert cap["rate"] == pytest.approx(400 / 16.46) and not cap["held"]
    assert "offered 50 req/s but sustained 24.3 req/s" in cap["warnings"][0]


def test_an_all_at_once_probe_sustains_its_completed_rate():
    at_once = probe(float("inf"), [0.0] * 60, ttft=0.1, e2e=[0.5 + i * 0.1 for i in range(60)])
    assert at_once["sustained_request_rate"] == at_once["request_throughput"] == pytest.approx(60 / 6.4)
    assert capacity_of([at_once], target=0.9)["rate"] == pytest.approx(60 / 6.4)


def test_a_probe_never_sustains_more_than_it_offered():
    # Offered 2 req/s, but the client sent all 8 at once (its loop was blocked past their due times):
    # 6 req/s completed, and the probe shows the server holds the 2 req/s it was asked for, no more.
    late = probe(2.0, [0.0] * 8, ttft=0.1, e2e=4 / 3)
    assert late["request_throughput"] == pytest.approx(6.0) and late["sustained_request_rate"] == 2.0
    assert capacity_of([late], target=0.9)["rate"] == 2.0


def test_a_probe_held_back_by_a_concurrency_limit_sustains_the_rate_it_sent_at():
    # Offered 50 req/s, but --max-concurrency let one request out every 50 ms: the server kept up
    # with 20 req/s, and that is all the probe shows.
    throttled = probe(50.0, [i * 0.05 for i in range(60)], ttft=0.1, e2e=0.2)
    assert throttled["sustained_request_rate"] == pytest.approx(20.0)
    assert capacity_of([throttled], target=0.9)["rate"] == pytest.approx(20.0)


def test_a_result_without_sustained_rates_reads_completed_ones():
    old = probe(256.0, [0.0] * 8, ttft=0.1, e2e=4 / 3)
    del old["sustained_request_rate"]
    assert capacity_of([old], target=0.9)["rate"] == pytest.approx(6.0)


def test_rate_resolution_is_two_poisson_deviations():
    assert rate_resolution(100) == pytest.approx(0.2) and rate_resolution(1000) == pytest.approx(0.0632, abs=1e-4)


def test_min_prompts_for_target():
    assert (min_prompts_for(0.9), min_prompts_for(0.99), min_prompts_for(0.5)) == (50, 500, 10)


def test_report_prints_the_noisy_warning(capsys):
    cap = capacity_of([probe(256.0, [0.0] * 8, ttft=0.1, e2e=4 / 3)], target=0.9)
    print_report({"sweep": [probe(256.0, [0.0] * 8, ttft=0.1, e2e=4 / 3)], "capacity": cap})
    out = capsys.readouterr().out
    assert "6.000 req/s" in out and "noisy probe: 8 prompts per probe" in out


def test_a_later_probe_sends_enough_prompts_for_four_of_the_latencies_seen_capped():
    # A passing probe whose p90 end-to-end latency is 2 s (nine of ten requests 1 s, one 11 s: the
    # 90th percentile interpolates 1 + 0.1 * 10 over ten sorted latencies).
    seen = probe(10.0, [i * 0.1 for i in range(10)], ttft=0.1, e2e=[1.0] * 9 + [11.0])
    failing = probe(20.0, [i * 0.05 for i in range(10)], ttft=0.9, e2e=30.0)  # misses the TTFT SLO
    assert probe_prompts(40.0, [], 0.9, 100, 4000) == 100  # a search's first probe: --num-prompts
    assert probe_prompts(40.0, [failing], 0.9, 100, 4000) == 100  # only passing probes' latencies count
    assert probe_prompts(40.0, [seen, failing], 0.9, 100, 4000) == 40 * 4 * 2 == 320
    assert probe_prompts(80.0, [seen], 0.9, 100, 4000) == 640  # grows with the rate
    slower = probe(10.0, [i * 0.1 for i in range(10)], ttft=0.1, e2e=5.0)  # a p90 of 5 s
    assert probe_prompts(40.0, [seen, slower], 0.9, 100, 4000) == 800  # and with the longest latency seen
    assert probe_prompts(80.0, [slower], 0.9, 100, 1000) == 1000  # capped
    assert probe_prompts(10.0, [seen], 0.9, 100, 4000) == 100  # never fewer than --num-prompts
    assert probe_prompts(80.0, [slower], 0.9, 2000, 1000) == 2000
    assert probe_prompts(math.inf, [seen], 0.9, 100, 4000) == 100  # an all-at-once run
    burst = probe(math.inf, [0.0] * 10, ttft=0.1, e2e=3.0)  # all at once: its latency is its queue's
    assert probe_prompts(40.0, [burst], 0.9, 100, 4000) == 100
    assert probe_prompts(40.0, [burst, seen], 0.9, 100, 4000) == 320


def test_a_probe_long_enough_holds_the_rate_the_short_one_could_not_show():
    # A server that keeps up with 85 req/s, ShareGPT-like: four of five answers take 1.5 s, one 10 s
    # (a p90 of 10 s). 1,000 prompts arrive in 11.8 s: the window after the first 10 s holds too
    # few departures for a steady state, and the probe reads 1,000 / 21.7 s completed (46 req/s: its
    # last long answer, sent at 995 / 85 s, ends it).
    rate = 85.0

    def server(count: int) -> dict:
        return probe(rate, [i / rate for i in range(count)], ttft=0.1,
                     e2e=[10.0 if i % 5 == 0 else 1.5 for i in range(count)])

    short = server(1000)
    assert short["sustained_request_rate"] == short["request_throughput"] == pytest.approx(1000 / (995 / rate + 10))
    assert not capacity_of([short], 0.9)["held"]
    # Probed again after it, at the same rate: 4 x 10 s of arrivals, and departures keep pace in the window.
    count = probe_prompts(rate, [short], 0.9, 1000, 4000)
    assert count == 3400
    steady = capacity_of([server(count)], 0.9)
    assert steady["held"] and steady["rate"] == rate and steady["probes"][0]["num_requests"] == 3400
