"""diagnose reads the engine a run used (its recorded engine_config_info): bytes per weight from the
real dtype (float32 on a CPU), a warning when its flags disagree, and advice that never repeats what
is already on or what the hardware cannot do."""

import json

import pytest

from goodserve.bench.metrics import compute_metrics
from goodserve.bench.result import build_result, save_json
from goodserve.diagnose.advisor import advise
from goodserve.diagnose.assumptions import resolve
from goodserve.diagnose.observations import Observations
from goodserve.diagnose.parallel import analyze_replica
from goodserve.hardware import Hardware, hardware_for_device
from goodserve.model.presets import get_preset
from test_diagnose import records, run_diagnose

SPEC = get_preset("llama-2-7b")  # 32 layers x 32 KV heads x 128: 2 x 32 x 32 x 128 = 262144 KV values a token
GPU = Hardware("test-gpu", {"bf16": 312e12}, 2e12, 80e9)

CPU_ENGINE = {"model": "dummy:llama-2-7b", "dtype": "float32", "quantization": "none",
              "kv_cache_dtype": "float32", "device": "cpu", "device_name": "cpu", "attention_backend": "torch",
              "scheduler_policy": "continuous", "enable_chunked_prefill": "True",
              "enable_prefix_caching": "True", "cuda_graphs": "False", "max_num_seqs": "256",
              "max_num_batched_tokens": "2048"}
GPU_ENGINE = {**CPU_ENGINE, "dtype": "bfloat16", "kv_cache_dtype": "bfloat16", "device": "cuda",
              "device_name": "NVIDIA H100 80GB HBM3", "attention_backend": "triton", "cuda_graphs": "True"}


def saved_result(tmp_path, engine):
    result = build_result({"dataset_name": "random", "engine_config": engine}, compute_metrics(records()),
                          records())
    save_json(result, tmp_path / "r.json")
    return str(tmp_path / "r.json")


def test_mbu_of_a_float32_cpu_engine_uses_4_bytes_a_weight(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert run_diagnose("--result", saved_result(tmp_path, CPU_ENGINE), "--json", str(out)) == 0
    decode = json.loads(out.read_text())["phases"][1]
    # records(): prompts 100 and 300 (mean 200), outputs 4 and 2 (mean 3), TPOTs 0.3/3 and 0.4/1 s
    # (median 0.25 s: 4 steps/s), Little's law batch 1. Context 200 + 3/2 = 201.5 tokens of
    # float32 KV (262144 values x 4 B); float32 weights, those a step reads: 6.74 B parameters less the
    # 32000 x 4096 embedding table, of which a token reads one row; the "cpu" table entry moves 0.1 TB/s.
    step_bytes = (6_738_415_616 - 32_000 * 4096) * 4 + 201.5 * 262144 * 4
    assert decode["mbu"] == pytest.approx(step_bytes * 4 / 0.1e12)
    assert "weights fp32, compute fp32, KV cache fp32, hardware cpu" in capsys.readouterr().out


def test_flags_that_disagree_with_the_engine_are_warned_and_overruled(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert run_diagnose("--result", saved_result(tmp_path, CPU_ENGINE), "--dtype", "bf16", "--hardware",
                        "h100-sxm", "--model", "llama-2-7b", "--json", str(out)) == 0
    text = capsys.readouterr().out
    assert "warning: --dtype bf16 differs from the engine the run used (weight_dtype fp32" in text
    assert "warning: --hardware h100-sxm differs" in text and "using cpu" in text
    assert "--model llama-2-7b differs" not in text  # dummy:llama-2-7b has the same shape
    report = json.loads(out.read_text())
    assert report["hardware"]["name"] == "cpu" and report["assumptions"]["weight_dtype"] == "fp32"


def test_without_a_recorded_engine_flags_and_defaults_apply():
    flags = {"model": None, "hardware": "cpu", "dtype": None, "kv_cache_dtype": None, "pipeline_micro_batches": None}
    a = resolve(flags, None, "")
    assert (a.model, a.weight_dtype, a.compute_dtype, a.kv_dtype) == ("smollm2-135m", "fp32", "fp32", "fp32")
    assert a.micro_batches  # the engine's default on a CPU
    a = resolve({**flags, "hardware": None, "dtype": "int4"}, None, "")
    assert (a.hardware, a.weight_dtype, a.compute_dtype, a.kv_dtype) == ("h100-sxm", "int4", "bf16", "bf16")
    assert not a.micro_batches  # and on CUDA
    assert not resolve({**flags, "pipeline_micro_batches": False}, None, "").micro_batches
    gguf = resolve(flags, {**CPU_ENGINE, "quantization": "gguf"}, "x")
    assert (gguf.weight_dtype, gguf.compute_dtype, gguf.kv_dtype) == ("int4", "fp32", "fp32")


def test_micro_batches_come_from_the_engine_the_run_used(tmp_path, capsys):
    out = tmp_path / "d.json"
    pipelined = {**CPU_ENGINE, "pipeline_micro_batches": "True"}
    assert run_diagnose("--result", saved_result(tmp_path, pipelined), "--pp", "2", "--no-pipeline-micro-batches",
                        "--json", str(out)) == 0
    assert "warning: --pipeline-micro-batches False differs from the engine the run used (micro_batches True" in \
           capsys.readouterr().out
    assert json.loads(out.read_text())["layout"] == {"tp": 1, "pp": 2, "dp": 1, "micro_batches": True}
    flags = {"model": None, "hardware": None, "dtype": None, "kv_cache_dtype": None, "pipeline_micro_batches": None}
    assert not resolve(flags, {**GPU_ENGINE, "pipeline_micro_batches": "False"}, "x").micro_batches
    # a result from before the label: the flag, else the engine's default on the device it ran on
    assert resolve(flags, CPU_ENGINE, "x").micro_batches and not resolve(flags, GPU_ENGINE, "x").micro_batches
    assert resolve({**flags, "pipeline_micro_batches": True}, GPU_ENGINE, "x").micro_batches


@pytest.mark.parametrize("device, name, expected", [
    ("cpu", "cpu", "cpu"), ("cuda", "NVIDIA H100 80GB HBM3", "h100-sxm"), ("cuda", "NVIDIA H100 PCIe", "h100-pcie"),
    ("cuda", "NVIDIA H200", "h200"), ("cuda", "NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("cuda", "NVIDIA A100-SXM4-80GB", "a100-80gb"), ("cuda", "Some Future GPU", None)])
def test_hardware_for_device(device, name, expected):
    assert hardware_for_device(device, name) == expected


def obs(**overrides):
    values = dict(source="test", mean_prompt_len=100, mean_output_len=100, concurrency=1.0, ttft_s=0.05,
                  tpot_s=0.01, input_throughput=1000.0, output_throughput=100.0, request_throughput=1.0)
    values.update(overrides)
    return Observations(**values)


def advised_options(engine) -> set[str]:
    """Every option advised for a run with every symptom: preemptions, then high TTFT / TPOT at low MBU."""
    options = set()
    for o in (obs(num_preemptions=5), obs(ttft_p99_s=5.0, tpot_s=0.5)):
        options |= {fix.option for advice in advise(o, analyze_replica(SPEC, GPU, o), engine) for fix in advice.fixes}
    return options


CHUNKED = "--enable-chunked-prefill --max-num-batched-tokens 4096"
PREFIX = "--enable-prefix-caching"
CONTINUOUS = "--scheduler-policy continuous"
GRAPHS = "--no-enforce-eager (CUDA graphs)"
GRAPHS_TRITON = "--no-enforce-eager --attention-backend triton (CUDA graphs and the Triton kernels)"
GPU_QUANT = "--quantization int8 (or int4)"
CPU_QUANT = "--quantization gguf (a GGUF model's own codes) or int4"
MEMORY_QUANT = "--quantization int8"
GPU_MEMORY = "--gpu-memory-utilization 0.95"
CPU_MEMORY = "--cpu-kv-cache-bytes (higher)"
KV_QUANT = "--kv-cache-dtype int8 (or fp8)"
TP = "--tensor-parallel-size 2 (or 4, 8)"
ALL = {CHUNKED, PREFIX, CONTINUOUS, GRAPHS, GRAPHS_TRITON, GPU_QUANT, CPU_QUANT, MEMORY_QUANT, GPU_MEMORY,
       CPU_MEMORY, KV_QUANT, TP}


@pytest.mark.parametrize("engine, advised", [
    # The default CPU engine: continuous, chunked prefill and prefix caching on; no CUDA graphs,
    # no Triton, and int8 is slower than float32 on a CPU.
    (CPU_ENGINE, {CPU_QUANT, MEMORY_QUANT, CPU_MEMORY, KV_QUANT}),
    ({**CPU_ENGINE, "quantization": "gguf", "kv_cache_dtype": "int8"}, {CPU_MEMORY}),
    # A GPU engine with graphs and Triton on but the batching features off.
    ({**GPU_ENGINE, "enable_chunked_prefill": "False", "enable_prefix_caching": "False",
      "scheduler_policy": "static"}, {CHUNKED, PREFIX, CONTINUOUS, GPU_QUANT, MEMORY_QUANT, GPU_MEMORY, KV_QUANT,
                                      TP}),
    ({**GPU_ENGINE, "cuda_graphs": "False", "attention_backend": "torch", "quantization": "int4",
      "kv_cache_dtype": "float8_e4m3fn"}, {GRAPHS, GRAPHS_TRITON, GPU_MEMORY, TP}),
    (None, ALL),  # engine unknown (a vLLM result): every fix
])
def test_advice_skips_what_is_on_or_beyond_the_hardware(engine, advised):
    assert advised_options(engine) & ALL == advised
