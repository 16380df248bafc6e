"""One tune trial's capacity search on a real in-process engine (dummy:tiny on the CPU): where it
starts, what it reports, and where a later trial stops probing."""

from __future__ import annotations

import math

import pytest

from goodserve.bench.capacity import capacity_of
from goodserve.config import EngineConfig
from goodserve.console import make_console
from goodserve.tune.measure import MIN_RATE_FACTOR, QualityGate, TrialRunner, bench_args, quality_settings

WORKLOAD = ["--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "4"]
OPTIONS = {"model": "dummy:tiny", "device": "cpu"}
MAX_PROMPTS = 24  # a later probe's length: 4 p90 latencies of the passing probes before it, at most this


def runner(slos_ms: dict[str, float], bisections: int = 0) -> TrialRunner:
    gate = QualityGate(EngineConfig(**OPTIONS), quality_settings(["a"], None, 64, 4, 32), {})  # off: random weights
    args = bench_args("dummy:tiny", WORKLOAD, slos_ms, num_prompts=12, seed=0, hourly_cost=None, progress=False)
    args.capacity_max_prompts = MAX_PROMPTS
    return TrialRunner(gate, args, make_console(), bisections)


@pytest.mark.slow  # a search of the doubling to its limit; the fast tier keeps a later trial's search (below)
def test_the_first_search_starts_at_the_rate_an_all_at_once_run_sustained():
    run = runner({"ttft": 60_000, "tpot": 60_000})  # every probe passes: the search doubles to its limit
    trial = run(OPTIONS, "start", "the configuration given", None)
    probes = trial["probes"]
    first = probes[0]
    assert math.isinf(first["request_rate"]) and first["sustained_request_rate"] == first["request_throughput"] > 0
    assert [p["request_rate"] for p in probes[1:]] == pytest.approx([first["sustained_request_rate"] * 2 ** i
                                                                     for i in range(5)])
    # The capacity is capacity_of's over the same probes (the all-at-once one can never beat a rated one
    # here), and the next trial starts from it.
    assert trial["capacity"] == capacity_of(probes, 0.9)["rate"] > 0
    assert run.start_rate == trial["capacity"]
    # The all-at-once run and the first rated probe send --num-prompts; each later one, after passing
    # probes, enough for a steady state at its doubled rate (16x the start's 12 prompts arrive within a
    # small part of one passing probe's p90 latency), capped, never fewer than before.
    counts = [p["num_requests"] for p in probes]
    assert counts[:2] == [12, 12] and counts == sorted(counts) and counts[-1] > 12 and max(counts) <= MAX_PROMPTS
    for p in probes[1:]:
        assert p["sustained_request_rate"] <= p["request_rate"]


def test_a_later_search_stops_halving_below_half_the_best_capacity():
    run = runner({"ttft": 1e-6})  # no request can meet it: every probe fails
    run.start_rate = 40.0  # the best capacity of an earlier trial
    trial = run(OPTIONS, "a step", "predicted to help", None)
    assert [p["request_rate"] for p in trial["probes"]] == [40.0, 40.0 * MIN_RATE_FACTOR]  # 10 req/s is below 20
    assert trial["capacity"] == 0.0
    assert "below half the best capacity so far (40 req/s) it was not searched" in trial["capacity_warnings"][-1]
    assert run.start_rate == 40.0


# "apart" serves from an engine process (the GPU path; the gate runs it on CUDA). Both measure the quality
# baseline and run a trial: the full tier's (the fast tier keeps a trial's search, above).
@pytest.mark.slow
@pytest.mark.parametrize("engine_process", [False, True], ids=["one-load", "apart"])
def test_the_quality_baseline_is_measured_before_a_candidates_engine_loads(monkeypatch, engine_process):
    # On a GPU every engine takes its gpu_memory_utilization share of the card: a baseline loaded
    # beside the candidate's engine found "no room for the KV cache" (tests/gpu/test_gpu_tune.py).
    from goodserve.engine.frontend.engine import Engine

    gate = QualityGate(EngineConfig(model="smollm2-135m", device="cpu"), quality_settings(["Hi"], None, 64, 2, 32),
                       {})
    loads = []  # per engine built: whether the baseline was measured by then
    built = Engine.__init__

    def recording_init(self, config, *args, **options):  # LLM passes its options on; an Engine gets them in config
        caching = options.get("enable_prefix_caching", config.enable_prefix_caching)
        loads.append((not caching, gate.baseline is not None))  # the baseline's prefix cache is off
        built(self, config, *args, **options)

    monkeypatch.setattr(Engine, "__init__", recording_init)
    args = bench_args("smollm2-135m", WORKLOAD, {"ttft": 60_000}, num_prompts=2, seed=0, hourly_cost=None,
                      progress=False)
    trial = TrialRunner(gate, args, make_console(), bisections=0, engine_process=engine_process,
                        out_of_time=lambda: True)({"model": "smollm2-135m", "device": "cpu"}, "start", "given", None)
    assert trial["quality"]["checked"] and trial["quality"]["passed"]
    baseline, candidate = loads[0], loads[1]
    assert baseline == (True, False)  # the unoptimized engine, first
    assert candidate == (False, True)  # the candidate's, once the baseline is measured (and its engine freed)
