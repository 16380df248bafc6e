"""Goodput capacity never exceeds the throughput a probe achieved, and says when probes are noisy:
synthetic probe records, capacity computed by hand."""

import pytest

from goodserve.bench.capacity import capacity_of, min_prompts_for
from goodserve.bench.metrics import compute_metrics
from goodserve.bench.records import RequestRecord
from goodserve.bench.report import print_report
from goodserve.bench.result import build_result

SLOS = {"ttft": 500.0}


def probe(offered_rate: float, sends: list[float], ttft: float, e2e: float) -> dict:
    records = [RequestRecord(i, 10, 4, t, t + ttft, [t + ttft, t + e2e], t + e2e, 4, "usage", None, True)
               for i, t in enumerate(sends)]
    return build_result({"request_rate": offered_rate}, compute_metrics(records, slos=SLOS), records)


def test_capacity_is_the_best_passing_probe_as_completed():
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
    assert cap["rate"] == pytest.approx(6.0)  # max(min(4, 4.10), min(256, 6.0)); never 256
    assert cap["rate"] <= max(p["request_throughput"] for p in (steady, burst))
    assert cap["noisy"] and len(cap["warnings"]) == 2
    assert "8 prompts per probe" in cap["warnings"][0] and "--num-prompts 50" in cap["warnings"][0]
    assert "offered 256 req/s but completed 6 req/s" in cap["warnings"][1]
    assert [p["request_throughput"] for p in cap["probes"]] == pytest.approx([8 / 1.95, 8 / 1.575, 6.0])


def test_capacity_of_a_probe_that_held_its_rate_is_not_noisy():
    # 50 prompts at 2 req/s, sent every 0.5 s, each done in 0.3 s: 50 / 24.8 s = 2.016 req/s completed.
    held = probe(2.0, [i * 0.5 for i in range(50)], ttft=0.1, e2e=0.3)
    cap = capacity_of([held], target=0.9)
    assert cap["rate"] == pytest.approx(2.0) and not cap["noisy"] and cap["warnings"] == []
    assert capacity_of([probe(2.0, [0.0], ttft=0.9, e2e=1.0)], 0.9)["rate"] == 0.0  # nothing passed


def test_min_prompts_for_target():
    assert (min_prompts_for(0.9), min_prompts_for(0.99), min_prompts_for(0.5)) == (50, 500, 10)


def test_report_prints_the_noisy_warning(capsys):
    cap = capacity_of([probe(256.0, [0.0] * 8, ttft=0.1, e2e=4 / 3)], target=0.9)
    print_report({"sweep": [probe(256.0, [0.0] * 8, ttft=0.1, e2e=4 / 3)], "capacity": cap})
    out = capsys.readouterr().out
    assert "6.000 req/s" in out and "noisy probe: 8 prompts per probe" in out
