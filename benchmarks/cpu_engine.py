"""The engine on the CPU (the default machine), beside Hugging Face transformers in the same run.

Embedded model (SmolLM2-135M-Instruct, float32; single stream also in float16):
  single stream  one prompt, greedy, 64 new tokens: decode tok/s (ours vs HF generate)
  offline        32 requests of mixed prompt lengths (16..256 tokens), 64 new tokens each
                 (ignore EOS): requests/s and output tok/s (ours vs HF generate on one padded batch)
Prints the step-time breakdown (schedule / prepare / forward / sample / detokenize) and writes
benchmarks/results/cpu_engine.json (or $OUT/cpu_engine.json when OUT is set).

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

NEW_TOKENS = 64


def hf_model(dtype: torch.dtype = torch.float32):
    path = embedded_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return model.eval()


@torch.no_grad()
def hf_single_stream(model, prompt_ids: list[int]) -> float:
    ids = torch.tensor([prompt_ids])
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return NEW_TOKENS / (time.perf_counter() - start)


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
    start = time.perf_counter()
    out = llm.generate({"prompt_token_ids": prompt_ids}, params)[0]
    elapsed = time.perf_counter() - start
    times = out.metrics.token_times
    return {"e2e_tok_s": NEW_TOKENS / elapsed, "decode_tok_s": (NEW_TOKENS - 1) / (times[-1] - times[0])}


def breakdown(llm: LLM) -> dict:
    s = llm.engine.stats()
    return {"steps": s.num_steps, "schedule_s": s.schedule_seconds_total, "prepare_s": s.prepare_seconds_total,
            "forward_s": s.forward_seconds_total, "sample_s": s.sample_seconds_total,
            "detokenize_s": s.detokenize_seconds_total, "output_s": s.output_seconds_total}


def main() -> None:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    llm = LLM("smollm2-135m", enable_prefix_caching=False)
    prompt = llm.tokenizer.encode("Write a short poem about the sea and the stars.")
    prompts = [rng.integers(100, 20000, n).tolist() for n in rng.integers(16, 257, 32)]
    result: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                    "torch": torch.__version__, "threads": torch.get_num_threads(), "model": "smollm2-135m fp32"}
    result["memory_probe"] = memory_probe(llm.engine.spec)
    ours = ours_single_stream(llm, prompt)
    llm.engine.times.__init__()  # the breakdown below covers the offline run only
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    ours_offline_s = time.perf_counter() - start
    result["ours"] = {"single_stream": ours, "offline_seconds": ours_offline_s,
                      "offline_requests_per_s": len(prompts) / ours_offline_s,
                      "offline_output_tok_s": len(prompts) * NEW_TOKENS / ours_offline_s,
                      "offline_step_breakdown": breakdown(llm)}
    del llm
    hf = hf_model()
    hf_tok_s = hf_single_stream(hf, prompt)
    hf_offline_s = hf_offline(hf, prompts)
    result["hf_transformers"] = {"version": transformers.__version__, "single_stream_tok_s": hf_tok_s,
                                 "offline_seconds": hf_offline_s,
                                 "offline_requests_per_s": len(prompts) / hf_offline_s,
                                 "offline_output_tok_s": len(prompts) * NEW_TOKENS / hf_offline_s}
    result["speedup_single_stream"] = ours["decode_tok_s"] / hf_tok_s
    # float16 weights halve the bytes each decode step reads (the CPU GEMV is bandwidth-bound).
    del hf
    hf_fp16_tok_s = hf_single_stream(hf_model(torch.float16), prompt)
    llm = LLM("smollm2-135m", dtype="float16", enable_prefix_caching=False)
    ours_fp16 = ours_single_stream(llm, prompt)
    result["float16_single_stream"] = {"ours": ours_fp16, "hf_tok_s": hf_fp16_tok_s,
                                       "speedup": ours_fp16["decode_tok_s"] / hf_fp16_tok_s,
                                       "speedup_vs_hf_fp32": ours_fp16["decode_tok_s"] / hf_tok_s}
    result["speedup_offline"] = hf_offline_s / ours_offline_s
    out_dir = os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "results"))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "cpu_engine.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
