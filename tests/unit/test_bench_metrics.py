"""Bench metric math against values computed by hand on synthetic timelines."""

import asyncio
import math

import pytest

from goodserve.bench.metrics import GpuCost, compute_metrics, parse_goodput_slos, slo_attainment
from goodserve.bench.records import RequestRecord
from goodserve.bench.runner import search_capacity
from goodserve.errors import InvalidRequestError


def rec(index, send, chunks, end, out, prompt, error=""):
    return RequestRecord(index=index, prompt_len=prompt, expected_output_len=8, send_time=send,
                         first_token_time=chunks[0] if chunks else None, chunk_times=chunks,
                         end_time=end, output_len=out, success=not error, error=error)


def timeline():
    return [
        rec(0, 0.0, [0.1, 0.3, 0.6], 0.6, 3, 10),  # TTFT 100 ms, TPOT (600-100)/2 = 250 ms, gaps 200, 300
        rec(1, 0.2, [0.4], 0.4, 1, 20),  # one token: TTFT 200 ms, no TPOT, no gaps
        rec(2, 0.5, [], 0.7, 0, 30, error="HTTP 500: boom"),  # failed: excluded from latencies
        rec(3, 1.0, [1.5, 1.6], 2.0, 2, 40),  # TTFT 500 ms, TPOT (1000-500)/1 = 500 ms, gap 100
    ]


def test_counts_and_throughput():
    m = compute_metrics(timeline())
    assert m["duration"] == pytest.approx(2.0)  # first send 0.0 to last end 2.0
    assert (m["completed"], m["failed"], m["num_requests"]) == (3, 1, 4)
    assert m["error_rate"] == pytest.approx(0.25)
    assert m["total_input_tokens"] == 70  # the failed request's 30 do not count
    assert m["total_output_tokens"] == 6
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["input_throughput"] == pytest.approx(35.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(38.0)


def test_latency_statistics():
    m = compute_metrics(timeline(), percentiles=(90.0, 99.0))
    # TTFT [100, 200, 500] ms
    assert m["mean_ttft_ms"] == pytest.approx(800 / 3)
    assert m["median_ttft_ms"] == pytest.approx(200)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(((100 - 800 / 3) ** 2 + (200 - 800 / 3) ** 2
                                                         + (500 - 800 / 3) ** 2) / 3))
    assert m["p90_ttft_ms"] == pytest.approx(200 + 0.8 * 300)  # linear interpolation at rank 1.8
    assert m["p99_ttft_ms"] == pytest.approx(200 + 0.98 * 300)
    assert m["max_ttft_ms"] == pytest.approx(500)
    # TPOT [250, 500] ms: the one-token request has none
    assert m["mean_tpot_ms"] == pytest.approx(375)
    assert m["p90_tpot_ms"] == pytest.approx(250 + 0.9 * 250)
    # ITL pooled gaps [200, 300, 100] ms
    assert m["mean_itl_ms"] == pytest.approx(200)
    assert m["median_itl_ms"] == pytest.approx(200)
    assert m["p99_itl_ms"] == pytest.approx(298)
    # E2E [600, 200, 1000] ms
    assert m["mean_e2el_ms"] == pytest.approx(600)
    assert m["max_e2el_ms"] == pytest.approx(1000)


def test_goodput_three_ways_labelled():
    slos = parse_goodput_slos(["ttft:250", "tpot:300"])
    m = compute_metrics(timeline(), slos=slos)
    # good: #0 (100 ms, 250 ms) and #1 (200 ms, one token so TPOT cannot fail it);
    # bad: #2 failed, #3 TTFT 500 ms.
    assert m["request_goodput"] == pytest.approx(2 / 2.0)
    assert m["slo_attainment"] == pytest.approx(50.0)
    assert slo_attainment(timeline(), {"e2el": 650}) == pytest.approx(0.5)  # 600 and 200 ms pass


def test_cost_per_million_tokens_and_request():
    m = compute_metrics(timeline(), cost=GpuCost(hourly_cost=2.0, num_gpus=1))
    run_cost = 2.0 * 2.0 / 3600  # $2/h for the 2 s run
    assert m["run_cost_usd"] == pytest.approx(run_cost)
    assert m["cost_per_1m_output_tokens"] == pytest.approx(run_cost / 6 * 1e6)
    assert m["cost_per_1m_input_tokens"] == pytest.approx(run_cost / 70 * 1e6)
    assert m["cost_per_request"] == pytest.approx(run_cost / 3)
    two_gpus = compute_metrics(timeline(), cost=GpuCost(hourly_cost=2.0, num_gpus=2))
    assert two_gpus["cost_per_request"] == pytest.approx(2 * run_cost / 3)


def test_single_request_and_one_token_output():
    m = compute_metrics([rec(0, 0.0, [0.05], 0.05, 1, 5)])
    assert m["completed"] == 1 and m["duration"] == pytest.approx(0.05)
    assert m["mean_ttft_ms"] == pytest.approx(50) and m["std_ttft_ms"] == 0
    assert m["mean_tpot_ms"] == 0 and m["mean_itl_ms"] == 0  # no samples: reported as 0, not NaN
    assert m["output_throughput"] == pytest.approx(20.0)


def test_all_failed_and_empty():
    m = compute_metrics([rec(0, 0.0, [], 0.01, 0, 5, error="cannot connect")])
    assert m["completed"] == 0 and m["failed"] == 1 and m["error_rate"] == 1.0
    assert m["request_throughput"] == 0 and m["mean_ttft_ms"] == 0
    empty = compute_metrics([], slos={"ttft": 1.0})
    assert empty["num_requests"] == 0 and empty["duration"] == 0 and empty["slo_attainment"] == 0


def test_record_derived_fields():
    r = rec(0, 1.0, [1.2, 1.5, 1.5, 1.9], 2.0, 4, 3)
    assert r.ttft == pytest.approx(0.2) and r.e2e == pytest.approx(1.0)
    assert r.tpot == pytest.approx(0.8 / 3)
    assert r.itls == pytest.approx([0.3, 0.0, 0.4])
    back = RequestRecord.from_dict(r.to_dict())
    assert back == r


@pytest.mark.parametrize("bad", ["ttft", "latency:5", "ttft:abc", "tpot:-1"])
def test_bad_goodput_slos(bad):
    with pytest.raises(InvalidRequestError):
        parse_goodput_slos([bad])


def test_capacity_search_finds_threshold():
    # Attainment falls from 100% to 0% at 6.5 req/s; target 90%.
    async def attainment(rate):
        return 1.0 if rate <= 6.5 else 0.0

    rate, probes = asyncio.run(search_capacity(attainment, 0.9, 1.0, bisections=6))
    assert 6.0 <= rate <= 6.5  # 1, 2, 4 pass, 8 fails, then bisect in (4, 8)
    assert [r for r, _ in probes[:4]] == [1.0, 2.0, 4.0, 8.0]
    assert rate == max(r for r, a in probes if a >= 0.9)


def test_capacity_search_when_start_rate_fails():
    async def attainment(rate):
        return 0.95 if rate <= 0.3 else 0.5

    rate, probes = asyncio.run(search_capacity(attainment, 0.9, 1.0, bisections=4))
    assert 0.25 <= rate <= 0.3
    never, _ = asyncio.run(search_capacity(lambda r: asyncio.sleep(0, 0.0), 0.9, 1.0, max_doublings=3))
    assert never == 0.0
    # A floor: 1 and 0.5 fail, 0.25 would be below 0.3, so the search ends with nothing passing.
    floored, probes = asyncio.run(search_capacity(attainment, 0.9, 1.0, bisections=4, min_rate=0.3))
    assert floored == 0.0 and [r for r, _ in probes] == [1.0, 0.5]


def test_capacity_search_bisects_no_finer_than_a_probe_resolves():
    async def attainment(rate):
        return 1.0 if rate <= 6.5 else 0.0

    # 8 fails; then 6 passes ([6, 8]: 33% apart), 7 fails (17%), 6.5 passes: 6.5 and 7 are 7.7% apart,
    # within the 10% a probe resolves, so the other three bisections are not run.
    rate, probes = asyncio.run(search_capacity(attainment, 0.9, 1.0, bisections=6, resolution=0.1))
    assert [r for r, _ in probes] == [1.0, 2.0, 4.0, 8.0, 6.0, 7.0, 6.5] and rate == 6.5
    _, finer = asyncio.run(search_capacity(attainment, 0.9, 1.0, bisections=6))
    assert len(finer) == 10


def test_capacity_search_stops_probing_when_out_of_time():
    # The caller's time runs out after the third probe: no fourth starts, and the best passing rate answers.
    probed = []

    async def attainment(rate):
        probed.append(rate)
        return 1.0 if rate <= 6.5 else 0.0

    rate, probes = asyncio.run(search_capacity(attainment, 0.9, 1.0, bisections=6,
                                               out_of_time=lambda: len(probed) >= 3))
    assert [r for r, _ in probes] == [1.0, 2.0, 4.0]
    assert rate == 4.0


def test_compare_ratios(tmp_path, capsys):
    from goodserve.bench.compare import compare_files
    from goodserve.bench.result import build_result, save_json

    slos = {"ttft": 250.0}
    a = build_result({}, compute_metrics(timeline(), slos=slos), timeline())
    faster = [rec(r.index, r.send_time / 2, [t / 2 for t in r.chunk_times], r.end_time / 2, r.output_len,
                  r.prompt_len, r.error) for r in timeline()]
    b = build_result({}, compute_metrics(faster, slos=slos), faster)
    save_json(a, tmp_path / "a.json")
    save_json(b, tmp_path / "b.json")
    compare_files(str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    rows = {line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines()
            if line.count("│") >= 4}
    assert "2.000x" in rows["request_throughput"]  # everything twice as fast
    assert "0.500x" in rows["mean_ttft_ms"]
