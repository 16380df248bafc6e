"""`goodserve bench --sweep-slo-scale` on a real in-process run: attainment per SLO scale in the
result, both attainment curves in the HTML report; the slo policy's targets ride on the requests."""

from goodserve.bench import command
from goodserve.bench.metrics import attainment_by_slo_scale
from goodserve.bench.records import RequestRecord
from goodserve.bench.result import load_json
from tests.test_bench_client import bench_args


def record(ttft_s: float, tpot_s: float) -> RequestRecord:
    return RequestRecord(index=0, prompt_len=4, expected_output_len=3, send_time=0.0, success=True,
                         first_token_time=ttft_s, chunk_times=[ttft_s, ttft_s + tpot_s, ttft_s + 2 * tpot_s],
                         end_time=ttft_s + 2 * tpot_s, output_len=3)


def test_attainment_by_scale_scores_the_same_records_against_scaled_targets():
    records = [record(0.1, 0.01), record(0.3, 0.01), record(0.1, 0.04), record(0.5, 0.05)]
    points = attainment_by_slo_scale(records, {"ttft": 200, "tpot": 20}, [0.5, 1, 2, 3])
    assert [p["slo_attainment"] for p in points] == [0.0, 25.0, 75.0, 100.0]


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
