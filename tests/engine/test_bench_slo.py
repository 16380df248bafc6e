"""`goodserve bench --sweep-slo-scale` on a real in-process run: attainment per SLO scale in the
result, both attainment curves in the HTML report; the slo policy's targets ride on the requests."""

import pytest

from goodserve.bench import command
from goodserve.bench.capacity import capacity_of
from goodserve.bench.metrics import attainment_by_slo_scale
from goodserve.bench.records import RequestRecord
from goodserve.bench.result import load_json
from test_bench_client import bench_args


def record(ttft_s: float, tpot_s: float) -> RequestRecord:
    return RequestRecord(index=0, prompt_len=4, expected_output_len=3, send_time=0.0, success=True,
                         first_token_time=ttft_s, chunk_times=[ttft_s, ttft_s + tpot_s, ttft_s + 2 * tpot_s],
                         end_time=ttft_s + 2 * tpot_s, output_len=3)


def test_attainment_by_scale_scores_the_same_records_against_scaled_targets():
    records = [record(0.1, 0.01), record(0.3, 0.01), record(0.1, 0.04), record(0.5, 0.05)]
    points = attainment_by_slo_scale(records, {"ttft": 200, "tpot": 20}, [0.5, 1, 2, 3])
    assert [p["slo_attainment"] for p in points] == [0.0, 25.0, 75.0, 100.0]


@pytest.mark.slow  # a sweep on an engine; the fast tier checks the sweep's points (test above)
def test_sweep_slo_scale_in_result_and_html(tmp_path):
    out, html = tmp_path / "r.json", tmp_path / "r.html"
    args = bench_args("--backend", "inprocess", "--model", "dummy:tiny", "--device", "cpu",
                      "--scheduler-policy", "slo", "--dataset-name", "random", "--num-prompts", "12",
                      "--random-input-len", "16", "--random-output-len", "4", "--ignore-eos",
                      "--sweep-request-rates", "100,inf", "--burstiness", "0.25",
                      "--goodput", "ttft:60000", "tpot:60000", "--sweep-slo-scale", "0.00001,1",
                      "--result-filename", str(out), "--save-html", str(html))
    assert command.run_command(args) == 0
    result = load_json(out)
    for run in result["sweep"]:
        assert run["engine_config"]["scheduler_policy"] == "slo"
        assert [p["scale"] for p in run["slo_scale_sweep"]] == [0.00001, 1]
        assert [p["slo_attainment"] for p in run["slo_scale_sweep"]] == [0.0, 100.0]
    page = html.read_text()
    assert "SLO attainment vs request rate" in page and "SLO attainment vs SLO scale" in page


def run_with_impossible_ttft(refuses_late: bool):
    """Eight requests, one at a time, each with a TTFT target no step can meet; the target and records."""
    import asyncio

    from goodserve.bench.arrivals import ArrivalConfig
    from goodserve.bench.inprocess import InProcessTarget
    from goodserve.bench.runner import BenchRun
    from goodserve.bench.workloads import BenchRequest
    from goodserve.config import EngineConfig

    target = InProcessTarget(EngineConfig(model="dummy:tiny", device="cpu", scheduler_policy="slo"),
                             ignore_eos=True, slo_ms={"ttft": 1e-6}, refuses_late=refuses_late)
    requests = [BenchRequest("", prompt_len, 4) for prompt_len in (3, 60, 3, 60, 3, 60, 3, 60)]

    async def go():
        try:
            return await BenchRun(target, requests, ArrivalConfig(max_concurrency=1)).run()
        finally:
            await target.close()

    return target, asyncio.run(go())


def test_inprocess_slo_refusals_are_recorded_as_429s():
    """An impossible TTFT target: once the engine has a step-time fit, the admission check refuses
    each request before it reaches the engine, as the server would with a 429."""
    target, records = run_with_impossible_ttft(refuses_late=True)
    assert records[0].success  # no fit yet: nothing is refused
    refused = [r for r in records if r.error.startswith("TtftUnattainable")]
    assert refused and refused[-1].index == 7 and not refused[-1].chunk_times
    assert target.admission.num_waiting == 0 and target.admission.waiting_prompt_tokens == 0


def test_inprocess_target_can_admit_every_request_to_measure_what_refusals_cost():
    """refuses_late=False (gpu_slo.py --no-admission): the same requests, none refused."""
    target, records = run_with_impossible_ttft(refuses_late=False)
    assert target.admission is None and all(r.success for r in records)


def test_goodput_capacity_search_writes_each_probes_sustained_rate(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = bench_args("--backend", "inprocess", "--model", "dummy:tiny", "--device", "cpu", "--dataset-name",
                      "random", "--num-prompts", "12", "--random-input-len", "8", "--random-output-len", "4",
                      "--ignore-eos", "--goodput", "ttft:60000", "tpot:60000", "--goodput-capacity",
                      "--capacity-start-rate", "50", "--capacity-max-doublings", "1", "--capacity-max-prompts", "30",
                      "--result-filename", str(out))
    assert command.run_command(args) == 0
    result = load_json(out)
    probes = result["capacity"]["probes"]
    assert [p["request_rate"] for p in probes] == [50.0, 100.0]  # both pass: one doubling, then the limit
    for run, p in zip(result["sweep"], probes):
        assert p["sustained_request_rate"] == run["sustained_request_rate"] <= run["request_rate"]
        assert p["num_requests"] == run["num_requests"] == run["num_prompts"] == run["completed"]
    # The first probe sends --num-prompts; the second, after it passed, enough for 4 of its p90 latencies.
    assert probes[0]["num_requests"] == 12 <= probes[1]["num_requests"] <= 30
    assert result["capacity"]["rate"] == capacity_of(result["sweep"], 0.9)["rate"] > 0
    assert "Goodput capacity (highest Poisson rate held, else sustained" in capsys.readouterr().out
