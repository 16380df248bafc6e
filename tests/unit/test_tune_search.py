"""goodserve tune's search logic on recorded trial numbers: which step it takes, what it keeps or
rejects, how it resumes and stops. No engine runs here (test_tune_e2e.py runs one)."""

from __future__ import annotations

import dataclasses
import json
import math

import gguf
import numpy as np
import pytest

from goodserve.diagnose.model_shape import resolve_spec
from goodserve.errors import InvalidRequestError
from goodserve.tune.bottleneck import Bottleneck, diagnose_trial, limiting_slo
from goodserve.tune.report import headroom_note
from goodserve.tune.search import MIN_GAIN, Budget, Search, ranked
from goodserve.tune.space import FP8_COMPUTE_GAIN, MIN_PREDICTED, candidate_steps, options_key, plan
from goodserve.tune.trial_log import TrialLog

SLOS = {"ttft": 500.0, "tpot": 50.0}
CPU_FLOAT32 = {"model": "smollm2-135m", "dtype": "float32", "quantization": "none", "kv_cache_dtype": "float32",
               "device": "cpu", "device_name": "cpu", "enable_prefix_caching": "True", "cuda_graphs": "False",
               "async_scheduling": "True", "scheduler_policy": "continuous", "speculative_method": "none"}


def bottleneck(**changes) -> Bottleneck:
    engine = {**CPU_FLOAT32, **changes.pop("engine", {})}
    fields = dict(device="cpu", num_gpus=0, limiting_slo="tpot", decode_verdict="bandwidth-bound", concurrency=2.0,
                  mean_prompt_len=32.0, mean_output_len=8.0, weight_share=1.0, speculation="off",
                  speculation_why="answers too short", repeated_prefixes=False, engine=engine,
                  spec=resolve_spec("smollm2-135m"))
    return Bottleneck(**{**fields, **changes})


def test_plan_puts_the_bytes_the_roofline_saves_first_and_says_why_it_skips():
    to_try, skipped = plan({"quantization": "none"}, bottleneck(), tried=set())
    names = [step.name for step, _ in to_try]
    # A 4-bit GGUF file is ~0.18x float32's bytes: the largest predicted gain on a bandwidth-bound decode.
    assert names[0] == "quantization=gguf" and to_try[0][0].predicted > 4
    assert to_try[0][1] == {"quantization": "gguf"}
    reasons = dict((step.name, why) for step, why in skipped)
    assert "int8 kernel" in reasons["quantization=int8"]  # no native int8 on the CPU
    assert "answers too short" in reasons["speculative_method=ngram"]  # diagnose's speculation advice


def test_plan_skips_a_step_predicted_slower_once_fewer_bytes_are_kept():
    # With the GGUF codes kept, int4 computed at load holds more bytes (bf16 embeddings): predicted < 1.
    b = bottleneck(engine={"quantization": "gguf"})
    to_try, skipped = plan({"quantization": "gguf"}, b, tried=set())
    assert "quantization=int4" not in [step.name for step, _ in to_try]
    why = dict((step.name, why) for step, why in skipped)["quantization=int4"]
    assert why.startswith("predicted 0.")
    # KV is a sliver of these decode steps' bytes: halving it predicts no gain worth a trial.
    assert "kv_cache_dtype=int8" not in [step.name for step, _ in to_try]


def test_plan_follows_the_limiting_slo():
    ttft = bottleneck(limiting_slo="ttft", decode_verdict="compute-bound", concurrency=250.0, mean_prompt_len=1500.0)
    to_try, skipped = plan({}, ttft, tried=set())
    names = [step.name for step, _ in to_try]
    assert "max_num_seqs=512" in names and "max_num_batched_tokens=4096" in names
    assert all(not n.startswith("quantization") for n in names)  # weight-only quantization leaves prefill alone
    capacity = bottleneck(decode_verdict="capacity-bound", weight_share=0.5)
    to_try, _ = plan({}, capacity, tried=set())
    kv = [step for step, _ in to_try if step.name == "kv_cache_dtype=int8"]
    assert kv and "twice the sequences" in kv[0].why


def test_plan_never_repeats_a_measured_configuration():
    to_try, skipped = plan({}, bottleneck(), tried={options_key({"quantization": "gguf"})})
    assert "quantization=gguf" not in [step.name for step, _ in to_try]
    assert ("quantization=gguf", "measured already") in [(step.name, why) for step, why in skipped]
    assert all(step.predicted >= MIN_PREDICTED for step, _ in to_try)


def trial(capacity: float | None, passed: bool = True, loss: float = 0.0) -> dict:
    return {"engine": CPU_FLOAT32, "capacity": capacity,
            "quality": {"checked": True, "passed": passed, "loss": loss, "summary": f"ppl {loss}"}}


class Recorded:
    """A measure that hands back recorded numbers, per configuration, and counts its calls."""

    def __init__(self, numbers: dict[str, dict]):
        self.numbers, self.calls = numbers, []

    def __call__(self, options, move, why, predicted):
        self.calls.append(move)
        return dict(self.numbers[options_key(options)])


def diagnose_from(trials: dict[str, Bottleneck]):
    """Recorded bottlenecks; else a bandwidth-bound decode with nothing broken first, whose plan offers the
    weight quantizations alone."""
    def diagnose(t: dict) -> Bottleneck:
        default = bottleneck(engine={"quantization": t["options"].get("quantization", "none")}, limiting_slo=None)
        return trials.get(options_key(t["options"]), default)
    return diagnose


def run(tmp_path, numbers, forced=(), max_trials=None, log_settings=None):
    measure = Recorded(numbers)
    log = TrialLog(tmp_path / "trials.jsonl", log_settings or {"model": "m"})
    search = Search(measure, diagnose_from({}), log, Budget(600), max_trials, [dict(f) for f in forced])
    return search.run({}), measure


def test_a_faster_candidate_past_the_quality_budget_is_rejected(tmp_path):
    numbers = {options_key({}): trial(1.0), options_key({"quantization": "int4"}): trial(9.0, passed=False, loss=0.3),
               options_key({"quantization": "gguf"}): trial(5.0)}
    outcome, measure = run(tmp_path, numbers, forced=[{"quantization": "int4"}], max_trials=3)
    by_move = {t["move"]: t for t in outcome.trials}
    assert by_move["quantization=int4"]["status"] == "rejected: quality"
    assert outcome.best["move"] == "quantization=gguf"  # 5 req/s kept over the rejected 9
    assert [t["move"] for t in ranked(outcome.trials)] == ["quantization=gguf", "start", "quantization=int4"]


def test_a_step_within_the_noise_is_not_kept(tmp_path):
    numbers = {options_key({}): trial(1.0), options_key({"quantization": "gguf"}): trial(1.0 + MIN_GAIN / 2)}
    outcome, _ = run(tmp_path, numbers, max_trials=2)
    assert outcome.trials[1]["status"] == "no gain" and outcome.best["move"] == "start"


def test_it_stops_when_nothing_predicted_to_help_is_left(tmp_path):
    numbers = {options_key({}): trial(1.0), options_key({"quantization": "gguf"}): trial(3.0)}
    measure = Recorded(numbers)
    # From the start the roofline offers only gguf; from gguf, nothing.
    start, after = bottleneck(speculation="off"), bottleneck(engine={"quantization": "gguf"}, limiting_slo=None)
    diagnose = diagnose_from({options_key({}): start, options_key({"quantization": "gguf"}): after})
    outcome = Search(measure, diagnose, TrialLog(tmp_path / "t.jsonl", {}), Budget(600)).run({})
    assert outcome.best["move"] == "quantization=gguf" and "no step left" in outcome.stop_reason
    assert measure.calls == ["start", "quantization=gguf"]
    assert len(outcome.rounds) == 2 and outcome.skipped  # every round says what it skipped and why


def test_an_interrupted_search_resumes_from_its_log_measuring_only_what_is_missing(tmp_path):
    numbers = {options_key({}): trial(1.0), options_key({"quantization": "int4"}): trial(9.0, passed=False),
               options_key({"quantization": "gguf"}): trial(5.0)}

    class Interrupted(Recorded):
        def __call__(self, options, move, why, predicted):
            if move == "quantization=gguf":
                raise KeyboardInterrupt
            return super().__call__(options, move, why, predicted)

    log_path = tmp_path / "trials.jsonl"
    with pytest.raises(KeyboardInterrupt):
        Search(Interrupted(numbers), diagnose_from({}), TrialLog(log_path, {"m": 1}), Budget(600), 3,
               [{"quantization": "int4"}]).run({})
    resumed = Recorded(numbers)
    outcome = Search(resumed, diagnose_from({}), TrialLog(log_path, {"m": 1}), Budget(600), 3,
                     [{"quantization": "int4"}]).run({})
    assert resumed.calls == ["quantization=gguf"]  # the start and int4 came from the log
    assert outcome.best["move"] == "quantization=gguf"
    assert [t["status"] for t in outcome.trials] == ["start", "rejected: quality", "kept"]


def test_the_budget_stops_before_a_trial_it_cannot_finish(tmp_path):
    now = [0.0]
    numbers = {options_key({}): trial(1.0), options_key({"quantization": "gguf"}): trial(3.0)}

    class Slow(Recorded):
        def __call__(self, options, move, why, predicted):
            now[0] += 100.0
            return super().__call__(options, move, why, predicted)

    budget = Budget(150, clock=lambda: now[0])
    outcome = Search(Slow(numbers), diagnose_from({}), TrialLog(tmp_path / "t.jsonl", {}), budget).run({})
    assert [t["move"] for t in outcome.trials] == ["start"]
    assert outcome.stop_reason.startswith("budget")


def test_the_trial_log_refuses_other_settings_and_survives_a_cut_line(tmp_path):
    path = tmp_path / "trials.jsonl"
    log = TrialLog(path, {"model": "a"})
    log.append("k1", {"capacity": 1.0})
    with path.open("a") as f:
        f.write('{"key": "k2", "trial": {"capa')  # killed mid-write
    assert TrialLog(path, {"model": "a"}).get("k1") == {"capacity": 1.0}
    with pytest.raises(InvalidRequestError, match="other settings"):
        TrialLog(path, {"model": "b"})
    empty = tmp_path / "empty.jsonl"
    TrialLog(empty, {"model": "a"})  # a run that stopped before its first trial
    assert TrialLog(empty, {"model": "b"}).trials == {}  # holds nothing to protect: the new settings take it


def test_limiting_slo_is_the_target_furthest_over_at_the_failing_probe():
    assert limiting_slo({"p90_ttft_ms": 400.0, "p90_tpot_ms": 80.0}, SLOS) == "tpot"  # 0.8x vs 1.6x
    assert limiting_slo({"p90_ttft_ms": 1500.0, "p90_tpot_ms": 60.0}, SLOS) == "ttft"
    assert limiting_slo(None, SLOS) is None


def test_diagnose_trial_reads_the_roofline_from_the_probes():
    at = {"completed": 50, "duration": 10.0, "total_input_tokens": 1600, "total_output_tokens": 400,
          "mean_e2el_ms": 400.0, "median_ttft_ms": 100.0, "median_tpot_ms": 40.0, "input_throughput": 160.0,
          "output_throughput": 40.0, "request_throughput": 5.0, "goodput_slos_ms": SLOS, "slo_attainment": 92.0}
    t = {"move": "start", "engine": CPU_FLOAT32, "at_capacity": at,
         "above_capacity": {**at, "p90_ttft_ms": 200.0, "p90_tpot_ms": 75.0}}
    b = diagnose_trial(t, SLOS, num_gpus=0)
    assert b.limiting_slo == "tpot" and b.concurrency == pytest.approx(2.0)  # Little's law: 0.4 s x 50 / 10 s
    assert b.mean_prompt_len == 32 and b.device == "cpu"
    assert 0.9 < b.weight_share <= 1.0  # 135M float32 weights against a few KV tokens
    assert b.decode_verdict in ("bandwidth-bound", "compute-bound")


def test_trials_round_trip_through_json(tmp_path):
    numbers = {options_key({}): trial(1.0), options_key({"quantization": "gguf"}): trial(3.0)}
    outcome, _ = run(tmp_path, numbers, max_trials=2)
    rows = [json.loads(line) for line in (tmp_path / "trials.jsonl").read_text().splitlines()]
    assert rows[0] == {"settings": {"model": "m"}} and [r["trial"]["move"] for r in rows[1:]] == [
        "start", "quantization=gguf"]


def test_a_configuration_that_cannot_be_diagnosed_ends_the_search_with_the_reason(tmp_path):
    def undiagnosable(t):
        raise InvalidRequestError("trial start: no request completed, nothing to diagnose")

    numbers = {options_key({}): trial(0.0)}
    outcome = Search(Recorded(numbers), undiagnosable, TrialLog(tmp_path / "t.jsonl", {}), Budget(600)).run({})
    assert outcome.stop_reason == "cannot diagnose start: trial start: no request completed, nothing to diagnose"


def test_the_outputs_rank_the_trials_and_chart_the_trade_offs(tmp_path):
    from goodserve.tune.report import write_outputs

    numbers = {options_key({}): trial(1.0), options_key({"quantization": "int4"}): trial(None, passed=False, loss=0.3),
               options_key({"quantization": "gguf"}): {**trial(5.0, loss=0.001), "cost_per_1m_tokens": 0.2}}
    outcome, _ = run(tmp_path, numbers, forced=[{"quantization": "int4"}], max_trials=3)
    settings = {"model": "smollm2-135m", "workload": "random", "slos_ms": SLOS}
    paths = write_outputs(outcome, tmp_path, settings)
    assert json.loads(paths["config"].read_text()) == {"quantization": "gguf"}
    result = json.loads(paths["json"].read_text())
    assert [(r["rank"], r["step"]) for r in result["ranked"]] == [(1, "quantization=gguf"), (2, "start"),
                                                                  (None, "quantization=int4")]
    assert result["serve_command"] == "goodserve serve --quantization gguf"
    html = paths["html"].read_text()
    assert html.count("data:image/png;base64,") == 2  # capacity against quality loss, and against cost
    assert "rejected: quality" in html and "goodserve serve --quantization gguf" in html


def test_a_start_past_the_quality_budget_is_named_as_the_reason_to_stop(tmp_path):
    numbers = {options_key({"quantization": "int4"}): {**trial(None, passed=False), "quality": {
        "passed": False, "summary": "perplexity +27.48%"}}}
    outcome = Search(Recorded(numbers), diagnose_from({}), TrialLog(tmp_path / "t.jsonl", {}), Budget(600)).run(
        {"quantization": "int4"})
    assert outcome.stop_reason.startswith("the starting configuration failed: past the quality budget")
    assert "perplexity +27.48%" in outcome.stop_reason and len(outcome.trials) == 1


def test_plan_on_gpus_offers_what_cuda_has_and_skips_what_is_on():
    gpu = {"model": "dummy:llama-3.1-8b", "dtype": "bfloat16", "device": "cuda", "device_name": "NVIDIA H100",
           "kv_cache_dtype": "bfloat16", "cuda_graphs": "False", "async_scheduling": "False"}
    b = bottleneck(engine=gpu, device="cuda", num_gpus=2, spec=resolve_spec("llama-3.1-8b"), weight_share=0.8,
                   decode_verdict="capacity-bound")
    names = {step.name: step for step, _ in plan({"enforce_eager": True}, b, tried=set())[0]}
    assert {"quantization=int4", "quantization=int8", "kv_cache_dtype=int8", "kv_cache_dtype=fp8",
            "enforce_eager=False", "tensor_parallel_size=2"} <= set(names)
    assert "quantization=gguf" not in names  # not a GGUF model
    assert "async_scheduling=True" not in names  # it needs CUDA graphs (diagnose's rule)
    assert names["quantization=int4"].predicted > names["quantization=int8"].predicted > 1  # fewer bytes, more
    graphs = bottleneck(engine={**gpu, "cuda_graphs": "True"}, device="cuda", num_gpus=1,
                        spec=resolve_spec("llama-3.1-8b"))
    names = {step.name for step, _ in plan({}, graphs, tried=set())[0]}
    assert "async_scheduling=True" in names
    assert not names & {"enforce_eager=False", "tensor_parallel_size=2"}  # graphs on; one GPU
    graphs.engine["async_scheduling"] = "True"
    assert "async_scheduling=True" not in {step.name for step, _ in plan({}, graphs, tried=set())[0]}


def test_plan_on_a_busy_gpu_skips_weight_only_quantization_and_tries_fp8_then_the_slo_policy():
    # Past CUDA_KERNEL_MAX_M rows a weight-only matmul dequantizes its weights (quant/linear.matmul_path):
    # at ~150 rows a step int4 and int8 move more bytes than bf16, whatever the roofline of their codes says.
    # fp8 stays an FP8 GEMM at any row count: half bf16's weight bytes.
    gpu = {"model": "dummy:llama-3.1-8b", "dtype": "bfloat16", "device": "cuda", "device_name": "NVIDIA H100",
           "kv_cache_dtype": "bfloat16", "cuda_graphs": "True", "async_scheduling": "True"}
    busy = bottleneck(engine=gpu, device="cuda", num_gpus=1, spec=resolve_spec("llama-3.1-8b"), weight_share=0.6,
                      concurrency=150.0, mean_prompt_len=220.0, mean_output_len=200.0)
    to_try, skipped = plan({}, busy, tried=set())
    reasons = dict((step.name, why) for step, why in skipped)
    assert "dequantizes" in reasons["quantization=int4"] and "dequantizes" in reasons["quantization=int8"]
    assert [step.name for step, _ in to_try[:2]] == ["quantization=fp8", "scheduler_policy=slo"]
    fp8 = to_try[0][0]
    halved = busy.read_bytes_of("fp8") / busy.read_bytes_of("none")
    assert fp8.predicted == pytest.approx(busy.decode_speedup(weight_ratio=halved))
    assert 1.3 < fp8.predicted < 1.5 and "FP8 GEMMs at every batch size" in fp8.why
    quiet = bottleneck(engine=gpu, device="cuda", num_gpus=1, spec=resolve_spec("llama-3.1-8b"), concurrency=8.0)
    assert plan({}, quiet, tried=set())[0][0][0].name == "quantization=int4"  # at 8 rows its kernels read codes


def test_quantization_moves_weigh_the_bytes_a_decode_step_reads(tmp_path):
    # llama-3.1-8b in bf16: 8.03 B parameters less the 128256 x 4096 embedding table a step reads a row of;
    # int4 keeps the table in bf16 and quantizes the 7.50 B others to 0.5 B and a bf16 scale per 128
    gpu = {"model": "dummy:llama-3.1-8b", "dtype": "bfloat16", "device": "cuda", "device_name": "NVIDIA H100"}
    b = bottleneck(engine=gpu, device="cuda", spec=resolve_spec("llama-3.1-8b"))
    matmuls = 8_030_261_248 - 128_256 * 4096
    assert b.read_bytes_of("none") == matmuls * 2
    assert b.read_bytes_of("int4") == pytest.approx(matmuls * 0.5 + matmuls / 128 * 2)
    # a GGUF file by its size, less its token embedding table (64 x 64 float32: 16 KiB) unless the lm_head is it
    path = tmp_path / "untied.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for name in ("token_embd.weight", "output.weight"):
        writer.add_tensor(name, np.zeros((64, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    untied = bottleneck(engine={"model": str(path)}, spec=dataclasses.replace(resolve_spec("smollm2-135m"),
                                                                             tie_word_embeddings=False))
    assert untied.read_bytes_of("gguf") == path.stat().st_size - 64 * 64 * 4
    tied = bottleneck(engine={"model": str(path)})  # smollm2-135m ties its embeddings
    assert tied.read_bytes_of("gguf") == path.stat().st_size


def test_fp8_is_offered_on_gpus_with_fp8_tensor_cores_only():
    h100 = {"model": "dummy:llama-3.1-8b", "dtype": "bfloat16", "device": "cuda",
            "device_name": "NVIDIA H100 80GB HBM3", "kv_cache_dtype": "bfloat16", "cuda_graphs": "True",
            "async_scheduling": "True"}
    spec = resolve_spec("llama-3.1-8b")

    def fp8_steps(engine: dict, **fields) -> list:
        b = bottleneck(engine=engine, spec=spec, weight_share=0.8, **{"device": engine["device"], **fields})
        return [step for step in candidate_steps({}, b) if step.name == "quantization=fp8"]

    assert len(fp8_steps(h100)) == 1
    assert fp8_steps({**h100, "device_name": "NVIDIA A100-SXM4-80GB"}) == []  # no FP8 tensor cores
    assert fp8_steps({**h100, "device_name": "Some Future GPU"}) == []  # not in the hardware table: unknown
    assert fp8_steps(CPU_FLOAT32) == []
    # TTFT breaks first on a compute-bound step: weight-only quantization is skipped, fp8's FLOP/s offered.
    ttft = dict(limiting_slo="ttft", decode_verdict="compute-bound", concurrency=250.0, mean_prompt_len=1500.0)
    (step,) = fp8_steps(h100, **ttft)
    assert step.predicted == FP8_COMPUTE_GAIN and "twice bf16's FLOP/s" in step.why
    # From fp8, the other quantizations are weighed against fp8's bytes (int8: the same bytes, no gain).
    b = bottleneck(engine={**h100, "quantization": "fp8"}, device="cuda", spec=spec, weight_share=0.8)
    steps = {step.name: step for step in candidate_steps({"quantization": "fp8"}, b)}
    assert "quantization=fp8" not in steps and steps["quantization=int8"].predicted == pytest.approx(1.0)


def _probe(offered: float, sustained: float) -> dict:
    return {"request_rate": offered, "request_throughput": sustained, "sustained_request_rate": sustained}


def test_the_headroom_note_weighs_the_capacity_against_what_an_overloaded_probe_sustained():
    """The H100's default 8B trial: all at once 34.3 req/s (drain-bound: left out), 34.3 offered and
    held, 68.6 offered and 49.2 sustained (overloaded), 51.4 offered and 45.7 sustained at the
    targets: 93% of the ceiling, so only a faster step can add much."""
    probes = [_probe(math.inf, 34.3), _probe(34.3, 34.3), _probe(68.6, 49.2), _probe(51.4, 45.7)]
    near = headroom_note({"capacity": 45.7, "probes": probes})
    assert "kept up with 49.2 req/s at most" in near and "93% of that" in near and "needs a faster step" in near
    far = headroom_note({"capacity": 20.0, "probes": probes})
    assert "41% of that" in far and "scheduling steps have room" in far
    assert headroom_note({"capacity": 45.7, "probes": probes[:2]}) is None  # no rated probe overloaded it
    past = headroom_note({"capacity": 61.0, "probes": probes})  # held within 10%, overloaded probes drew other requests
    assert "kept up with 49.2 req/s at most" in past and "as much or more" in past and "% of that" not in past
    assert "at its ceiling" in past and "needs a faster step" in past
    assert headroom_note({"capacity": 0.0, "probes": probes}) is None  # no rate met the targets


def test_the_headroom_of_a_step_weighs_its_ceiling_against_the_starting_capacity():
    """The H100's fp8 trial after a 46.1 req/s start: 60 offered and held at 50.9, then 120 and 90
    overloaded at 50.7 and 57.7 sustained: scheduling on top of fp8 could reach 1.25x the start."""
    probes = [_probe(60.0, 50.9), _probe(120.0, 50.7), _probe(90.0, 57.7)]
    note = headroom_note({"move": "quantization=fp8", "capacity": 50.9, "probes": probes}, start_capacity=46.1)
    assert note.startswith("headroom: overloaded, quantization=fp8 kept up with 57.7 req/s at most (1.25x the "
                           "starting configuration's capacity)") and "88% of that" in note
