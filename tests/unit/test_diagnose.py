"""Roofline math, verdicts, advice, and the diagnose command, against hand-computed values."""

import argparse
import json

import pytest

from goodserve.bench.metrics import compute_metrics
from goodserve.bench.records import RequestRecord
from goodserve.bench.result import build_result, save_json
from goodserve.diagnose import command as diagnose_command
from goodserve.diagnose.advisor import advise
from goodserve.diagnose.observations import Observations, from_bench_result, observations_from_scrapes
from goodserve.diagnose.parallel import analyze_replica
from goodserve.diagnose.roofline import analyze_decode, decode_step_bytes, flops_per_token, prefill_flops
from goodserve.errors import InvalidRequestError
from goodserve.hardware import Hardware, get_hardware, measure_local
from goodserve.model.presets import get_preset

SPEC = get_preset("llama-2-7b")  # 32 layers, 32 heads x 128, MHA: KV 524288 B/token in bf16
GPU = Hardware("test-gpu", {"bf16": 312e12}, 2e12, 80e9)  # ridge 156 FLOP/B


def obs(**overrides):
    values = dict(source="test", mean_prompt_len=100, mean_output_len=100, concurrency=1.0, ttft_s=0.05,
                  tpot_s=0.01, input_throughput=1000.0, output_throughput=100.0, request_throughput=1.0)
    values.update(overrides)
    return Observations(**values)


def test_flops_per_token_and_prefill():
    n = SPEC.num_matmul_params()
    assert flops_per_token(SPEC, 0) == 2 * n
    assert flops_per_token(SPEC, 1000) == 2 * n + 4 * 32 * 1000 * 4096
    # Prefill of P tokens = the sum of per-token FLOPs at contexts 1..P (causal attention).
    assert prefill_flops(SPEC, 50) == pytest.approx(sum(flops_per_token(SPEC, i) for i in range(1, 51)))


def test_decode_mbu_batch_1():
    # 100 tok/s, batch 1, context 100 + 100/2 = 150: per step the weights a token reads (6.74 B parameters
    # less the 32000 x 4096 embedding table, of which it reads one row) + 150 tokens of KV.
    step_bytes = (6_738_415_616 - 32_000 * 4096) * 2 + 150 * 524288
    assert decode_step_bytes(SPEC, 1, 150) == step_bytes
    d = analyze_decode(SPEC, GPU, obs())
    assert d.mbu == pytest.approx(step_bytes * 100 / 2e12)
    assert d.mfu == pytest.approx(flops_per_token(SPEC, 150) * 100 / 312e12)
    assert d.ridge_point == pytest.approx(156)
    assert d.verdict == "bandwidth-bound" and d.intensity < 2


def test_decode_verdicts_compute_and_capacity():
    big_batch = analyze_decode(SPEC, GPU, obs(concurrency=512, mean_prompt_len=10, mean_output_len=10))
    assert big_batch.intensity > 156 and big_batch.verdict == "compute-bound"
    assert analyze_decode(SPEC, GPU, obs(num_preemptions=3)).verdict == "capacity-bound"
    assert analyze_decode(SPEC, GPU, obs(kv_cache_usage=0.99)).verdict == "capacity-bound"
    # 2000 sequences of 200 tokens need 210 GB of KV: more than an 80 GB GPU holds.
    assert analyze_decode(SPEC, GPU, obs(concurrency=2000)).verdict == "capacity-bound"


def test_prefill_is_compute_bound_for_long_prompts():
    prefill, _ = analyze_replica(SPEC, GPU, obs(mean_prompt_len=2000, ttft_s=0.2))
    assert prefill.verdict == "compute-bound"
    assert prefill.mfu == pytest.approx(prefill_flops(SPEC, 2000) / 0.2 / 312e12)


def test_advice_ranked_with_options_and_confirmations():
    o = obs(num_preemptions=5, tpot_p99_s=0.2, slos_ms={"tpot": 50.0})
    advice = advise(o, analyze_replica(SPEC, GPU, o))
    symptoms = [a.symptom for a in advice]
    # TPOT at 4x its SLO (severity 3) outranks 5 preemptions (severity 1.05).
    assert symptoms[:2] == ["high TPOT", "preemptions / KV cache full"]
    kv_fix = advice[1].fixes[0]
    assert kv_fix.option.startswith("--kv-cache-dtype") and "num_preemptions" in kv_fix.confirm
    assert all(f.option.startswith("--") and f.effect and f.confirm for a in advice for f in a.fixes)


def test_no_advice_when_healthy_and_prefix_rule():
    healthy = obs()  # 100 tok/s at batch 1 on an H100 is 40% MBU: no symptom
    assert advise(healthy, analyze_replica(SPEC, get_hardware("h100-sxm"), healthy)) == []
    slow = obs(tpot_s=0.05)  # 8% MBU at batch 1
    assert [a.symptom for a in advise(slow, analyze_replica(SPEC, get_hardware("h100-sxm"), slow))] == [
        "low throughput at low MBU"]
    missing = obs(repeated_prefixes=True, prefix_cache_hit_rate=0.05)
    assert "low prefix-cache hit rate on repeated prefixes" in [
        a.symptom for a in advise(missing, analyze_replica(SPEC, GPU, missing))]


def records():
    return [
        RequestRecord(0, 100, 4, 0.0, 0.1, [0.1, 0.2, 0.3, 0.4], 0.4, 4, "usage", 50, True),
        RequestRecord(1, 300, 4, 0.0, 0.2, [0.2, 0.4], 0.6, 2, "usage", 0, True),
        RequestRecord(2, 50, 4, 0.5, None, [], 1.0, 0, "none", None, False, "boom"),
    ]


def test_observations_from_bench_result(tmp_path):
    result = build_result({"dataset_name": "prefix_repetition"}, compute_metrics(records()), records())
    save_json(result, tmp_path / "r.json")
    o = from_bench_result(str(tmp_path / "r.json"))
    assert o.mean_prompt_len == 200 and o.mean_output_len == 3
    assert o.concurrency == pytest.approx((0.4 + 0.6) / 1.0)  # Little's law over the 1 s run
    assert o.prefix_cache_hit_rate == pytest.approx(50 / 400)
    assert o.repeated_prefixes and o.ttft_s == pytest.approx(0.15)


def test_observations_from_a_result_without_records(tmp_path):
    """vLLM's result files (and ours trimmed for the repository) carry summary keys only."""
    result = build_result({"dataset_name": "random"}, compute_metrics(records()), records())
    result.pop("records")
    save_json(result, tmp_path / "r.json")
    o = from_bench_result(str(tmp_path / "r.json"))
    assert o.mean_prompt_len == 200 and o.mean_output_len == 3
    assert o.concurrency == pytest.approx(1.0) and o.prefix_cache_hit_rate is None


def test_observations_from_two_scrapes():
    before = {"e2e_request_latency_seconds_count": 10, "e2e_request_latency_seconds_sum": 20.0,
              "prompt_tokens_total": 1000, "generation_tokens_total": 500,
              "time_to_first_token_seconds_count": 10, "time_to_first_token_seconds_sum": 1.0,
              "prefix_cache_queries_total": 1000, "prefix_cache_hits_total": 0}
    after = {"e2e_request_latency_seconds_count": 30, "e2e_request_latency_seconds_sum": 60.0,
             "prompt_tokens_total": 5000, "generation_tokens_total": 2500,
             "time_to_first_token_seconds_count": 30, "time_to_first_token_seconds_sum": 5.0,
             "prefix_cache_queries_total": 5000, "prefix_cache_hits_total": 1000,
             "kv_cache_usage_perc": 0.5, "num_preemptions_total": 2}
    o = observations_from_scrapes(before, after, 10.0, "http://x/metrics")
    assert (o.mean_prompt_len, o.mean_output_len) == (200, 100)  # 4000 / 20 and 2000 / 20
    assert o.concurrency == pytest.approx(4.0)  # 40 request-seconds over 10 s
    assert o.ttft_s == pytest.approx(0.2) and o.output_throughput == pytest.approx(200)
    assert o.prefix_cache_hit_rate == pytest.approx(0.25) and o.num_preemptions == 2
    with pytest.raises(InvalidRequestError, match="no request finished"):
        observations_from_scrapes(before, before, 10.0, "http://x/metrics")


def test_host_share_and_gc_pauses_from_two_scrapes():
    """The step-time split by phase and the GC pauses, as deltas over the window."""
    phases = ("schedule", "prepare", "forward", "sample", "detokenize", "output")
    before = {"e2e_request_latency_seconds_count": 0, "gc_pause_seconds_sum": 1.0,
              **{f"step_time_seconds_total{{phase={p}}}": 1.0 for p in phases}}
    spent = {"schedule": 0.5, "prepare": 1.0, "forward": 5.0, "sample": 0.5, "detokenize": 2.0, "output": 1.0}
    after = {"e2e_request_latency_seconds_count": 5, "gc_pause_seconds_sum": 1.2,
             **{f"step_time_seconds_total{{phase={p}}}": 1.0 + spent[p] for p in phases}}
    o = observations_from_scrapes(before, after, 10.0, "u")
    assert o.step_phase_shares["detokenize"] == pytest.approx(0.2)  # 2 of the 10 s of steps
    assert o.host_share == pytest.approx(0.5) and o.gc_pause_share == pytest.approx(0.02)  # 0.2 s in 10 s
    bare = observations_from_scrapes({}, {"e2e_request_latency_seconds_count": 1}, 1.0, "u")
    assert bare.host_share is None and bare.gc_pause_share is None  # another server, or an older goodserve


def test_host_bound_steps_advice_skips_what_is_on():
    shares = {"schedule": 0.05, "prepare": 0.15, "forward": 0.5, "sample": 0.05, "detokenize": 0.2, "output": 0.05}
    o = obs(step_phase_shares=shares, gc_pause_share=0.012)
    advice = {a.symptom: a for a in advise(o, analyze_replica(SPEC, get_hardware("h100-sxm"), o))}
    host = advice["host-bound steps"]
    assert host.severity == pytest.approx(0.5 / 0.3 - 1)
    assert "50% of the engine's step time" in host.evidence and "detokenize 20%, prepare 15%" in host.evidence
    assert "1.2% of the wall time" in host.evidence
    gpu = {"device": "cuda", "cuda_graphs": "True", "async_scheduling": "False"}
    options = lambda engine: [f.option for f in advise(o, analyze_replica(SPEC, GPU, o), engine)[0].fixes]
    assert "--async-scheduling" in options(gpu)
    assert "--async-scheduling" not in options({**gpu, "async_scheduling": "True"})  # on already
    assert "--async-scheduling" not in options({**gpu, "cuda_graphs": "False"})  # it needs graphs
    assert "--async-scheduling" not in options({"device": "cpu"})
    own_process = "the engine in its own process (serve's default: drop --no-engine-process)"
    assert own_process in options({**gpu, "engine_process": "False"}) and own_process in options({"device": "cpu"})
    assert own_process not in options({**gpu, "engine_process": "True"})  # there already
    calm = obs(step_phase_shares={**shares, "forward": 0.8, "detokenize": 0.05, "prepare": 0.0})
    assert "host-bound steps" not in [a.symptom for a in advise(calm, analyze_replica(SPEC, GPU, calm))]


def test_host_bound_steps_explain_low_mbu_instead_of_asking_for_bigger_batches():
    """A bandwidth-bound decode at low MBU asks for bigger batches, unless the host bounds the steps:
    then a bigger batch made the server slower (BENCHMARKS.md), and the host rule says why."""
    shares = {"schedule": 0.05, "prepare": 0.5, "forward": 0.2, "sample": 0.05, "detokenize": 0.15, "output": 0.05}
    low_mbu = dict(concurrency=4.0, tpot_s=0.05)  # 80 tok/s at batch 4 of a 7B model: MBU ~8%
    symptoms = lambda o: [a.symptom for a in advise(o, analyze_replica(SPEC, get_hardware("h100-sxm"), o))]
    assert "low throughput at low MBU" in symptoms(obs(**low_mbu))
    host_bound = obs(**low_mbu, step_phase_shares=shares)
    assert "low throughput at low MBU" not in symptoms(host_bound)
    host = next(a for a in advise(host_bound, analyze_replica(SPEC, get_hardware("h100-sxm"), host_bound))
                if a.symptom == "host-bound steps")
    assert "decode MBU " in host.evidence


def test_measure_local_probes_this_machine():
    hw = measure_local("cpu", copy_bytes=1 << 20, matmul_n=64, repeats=2)
    assert hw.measured and hw.memory_bandwidth > 0 and hw.flops_for("bf16") > 0 and hw.memory_bytes > 1e9


def run_diagnose(*argv):
    parser = argparse.ArgumentParser()
    diagnose_command.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["diagnose", *argv])
    return args.func(args)


def test_diagnose_command_from_result(tmp_path, capsys):
    result = build_result({"dataset_name": "random"}, compute_metrics(records()), records())
    save_json(result, tmp_path / "r.json")
    out = tmp_path / "d.json"
    assert run_diagnose("--model", "llama-2-7b", "--hardware", "a100-80gb", "--result",
                        str(tmp_path / "r.json"), "--json", str(out)) == 0
    text = capsys.readouterr().out
    assert "bandwidth-bound" in text and "ridge point" in text
    report = json.loads(out.read_text())
    assert [p["phase"] for p in report["phases"]] == ["prefill", "decode"]


def test_diagnose_command_bad_input(tmp_path):
    with pytest.raises(InvalidRequestError, match="unknown hardware"):
        run_diagnose("--model", "llama-2-7b", "--hardware", "tpu-v9")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InvalidRequestError, match="not a bench result"):
        run_diagnose("--model", "llama-2-7b", "--result", str(tmp_path / "bad.json"))


def test_a_parallel_layout_is_one_replica_of_tp_gpus():
    from goodserve.diagnose.parallel import Layout, per_replica, replica_hardware

    spec, h100 = get_preset("llama-3.1-70b"), get_hardware("h100-sxm")
    four = replica_hardware(h100, Layout(tp=4))
    assert (four.memory_bandwidth, four.memory_bytes, four.flops_for("bf16")) == (4 * 3.35e12, 320e9, 4 * 989.4e12)
    assert replica_hardware(h100, Layout(tp=2, pp=2)).memory_bandwidth == 2 * 3.35e12  # stages take turns
    # 50 tok/s at batch 1, context 150: 139.0 GB of weights (141.1 less the 128256 x 8192 embedding table,
    # of which a token reads one row) + 150 x 327680 B of KV per step, over 4 GPUs
    decode = analyze_decode(spec, four, obs(tpot_s=0.02))
    assert decode.mbu == pytest.approx(((70_553_706_496 - 128_256 * 8192) * 2 + 150 * 327_680) * 50 / (4 * 3.35e12))
    assert per_replica(obs(concurrency=8.0), Layout(dp=2)).concurrency == 4.0


def test_micro_batches_put_the_stages_in_flight_on_the_roofline():
    from goodserve.diagnose.parallel import Layout, replica_hardware

    h100, on = get_hardware("h100-sxm"), Layout(pp=2, micro_batches=True)
    # one sequence is one micro-batch: the stages take turns, as without micro-batches
    assert replica_hardware(h100, on, 1) == replica_hardware(h100, Layout(pp=2), 1)
    assert replica_hardware(h100, on, 1).memory_bandwidth == 3.35e12
    # 32 sequences fill both stages: twice the bandwidth and FLOP/s, not only the memory
    both = replica_hardware(h100, on, 32)
    assert (both.memory_bandwidth, both.flops_for("bf16"), both.memory_bytes) == (2 * 3.35e12, 2 * 989.4e12, 160e9)
    assert replica_hardware(h100, Layout(pp=2), 32).memory_bandwidth == 3.35e12  # off: the stages take turns
    # TP 2 x PP 4: 3 sequences keep 3 stages of 2 GPUs busy, 32 all 4
    assert replica_hardware(h100, Layout(tp=2, pp=4, micro_batches=True), 3).memory_bandwidth == 6 * 3.35e12
    assert replica_hardware(h100, Layout(tp=2, pp=4, micro_batches=True), 32).memory_bandwidth == 8 * 3.35e12


def test_a_decode_round_over_micro_batches_reads_the_weights_once_each():
    from goodserve.diagnose.parallel import Layout

    spec, h100 = get_preset("llama-3.1-70b"), get_hardware("h100-sxm")
    o = obs(concurrency=8.0, tpot_s=0.05)  # 20 rounds/s at a context of 100 + 100 / 2 = 150
    weights, kv = (70_553_706_496 - 128_256 * 8192) * 2, 8 * 150 * 327_680  # a step reads no embedding table
    prefill, decode = analyze_replica(spec, h100, o, Layout(tp=4, pp=2, micro_batches=True))
    # 8 sequences fill both stages: 2 micro-batches each read the weights, over 2 stages x 4 GPUs' bandwidth
    assert decode.mbu == pytest.approx((2 * weights + kv) * 20 / (8 * 3.35e12))
    turns_prefill, turns = analyze_replica(spec, h100, o, Layout(tp=4, pp=2))
    assert turns.mbu == pytest.approx((weights + kv) * 20 / (4 * 3.35e12))
    assert decode.mfu == pytest.approx(turns.mfu / 2)  # the same FLOPs over twice the peak
    # a prompt crosses the stages in turn either way: its peak is one stage's 4 GPUs
    assert prefill.mfu == turns_prefill.mfu == pytest.approx(prefill_flops(spec, 100) / 0.05 / (4 * 989.4e12))


def test_diagnose_command_with_pipeline_micro_batches(capsys):
    argv = ("--model", "llama-3.1-70b", "--hardware", "h100-sxm", "--tp", "4", "--pp", "2")
    assert run_diagnose(*argv) == 0
    assert "off: the stages take turns on each step" in capsys.readouterr().out  # the engine's CUDA default
    assert run_diagnose(*argv, "--pipeline-micro-batches") == 0
    assert "on: from 2 requests in flight the 2 stages decode at once" in capsys.readouterr().out


def test_diagnose_reports_what_sliding_windows_save(capsys):
    """Gemma-3-12B: 40 local layers keep 1024 tokens, 8 global ones all 131072; a layer's token is
    2 (K, V) x 8 heads x 256 dims x 2 bytes."""
    assert run_diagnose("--model", "gemma-3-12b", "--hardware", "h100-sxm") == 0
    layer_token = 2 * 8 * 256 * 2
    held, all_global = layer_token * (8 * 131072 + 40 * 1024), layer_token * 48 * 131072
    assert f"{held / 1e9:.3f} GB ({held / all_global:.0%} of all-global's {all_global / 1e9:.3f} GB)" \
        in capsys.readouterr().out


def test_diagnose_command_with_tensor_parallelism(capsys):
    assert run_diagnose("--model", "llama-3.1-70b", "--hardware", "h100-sxm", "--tensor-parallel-size", "4") == 0
    text = capsys.readouterr().out
    assert "4 x h100-sxm (TP 4, PP 1)" in text and "35.28 GB per GPU" in text
    # 4 x 3.0 TB/s (a copy's, of the datasheet's 3.35) / 139.0 GB read a step (the 141.1 GB of weights less the
    # 2.1 GB embedding table) = 86 tok/s (11.58 ms); 160 all-reduces of 16 KiB: 160 x 8.5 us + a ring's 1.5 x
    # 2.6 MB over 450 GB/s = 1.37 ms, and 80 layers x 24.6 us = 1.97 ms more per token: 67.0 tok/s
    assert "1.34e+04 GB/s" in text and "1.2e+04 GB/s (89.6% of peak)" in text  # 4 x 3.35 and 4 x 3.0 TB/s
    assert "86 tok/s" in text and "160 x 16 KiB, 1.37 ms at 8.5 us each" in text and "67 tok/s" in text
    with pytest.raises(InvalidRequestError, match="must divide 64 heads"):
        run_diagnose("--model", "llama-3.1-70b", "--tp", "3")
