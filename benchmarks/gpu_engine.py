"""The engine on the GPU: correctness against the torch path, then its headline numbers.

Parts (run any subset, in one process, with --parts):
  check       embedded model on CUDA: Triton kernels vs the torch path, CUDA graphs vs eager (greedy
              tokens must agree in float32; bf16 logits close to float32)
  decode      dummy llama-3.1-8b bf16, batch 1, 128-token prompt, 256 new tokens: tok/s and MBU
  int8, int4, decode_fp8  the same with int8 / int4 / fp8 layers (lm_head int8); decode_fp8_head16 with
              fp8 layers and the lm_head in bf16, as vLLM's fp8 keeps it
  throughput  500 requests, ShareGPT-like lengths (input mean ~200, output mean ~180, ignore_eos),
              all at once: requests/s, output tok/s; also every output fixed at 180 (the peer's shape)
  sharegpt    only the ShareGPT-like run of `throughput`
  sharegpt_fp8  `sharegpt:fp8`: the same with --quantization fp8 (FP8 GEMMs at every batch size)
  profile_sharegpt  the ShareGPT-like run under torch.profiler: device time per kernel over the
              whole run (with :nopdl, so a kernel's time excludes waiting for its predecessor)
  nano        256 requests, input and output lengths uniform in 100..1024 (nano-vllm's workload)
  peer        Hugging Face transformers on the same shape: generate() at batch 1 (eager) and
              generate_batch (continuous batching, paged attention) on the fixed-180 workload
A part may carry variants after colons, measured in the same process; each is an engine option
(EngineConfig, its `kernels` KernelOptions), so engines of different variants never share state:
`decode:nopdl` runs it with programmatic dependent launch off (ops/pdl.py), `decode:cublasqkv`
with qkv_proj on cuBLAS (not the Triton GEMV, ops/gemv_linear.py), `sharegpt:prefillonly` with a
mixed batch's decodes left in the prefill attention kernel (not given to the decode kernel),
`sharegpt:t16384` with max_num_batched_tokens 16384, `sharegpt:halvedsplits` with decode attention
split to fill the GPU once (not twice), `sharegpt:kvfp8` with an fp8 KV cache, `sharegpt:fp8` with
fp8 weights and activations (quant/fp8_linear.py),
`sharegpt:smallestgraph` with every decode batch in the smallest graph that holds it (not the
fastest measured at start-up), `sharegpt:makespan` (or `throughput:makespan`) with the makespan
scheduling policy (engine/core/makespan.py; `slack<x>` and `admit<n>` set makespan_slack and
makespan_min_admit), `:nomixedgraphs` with every step that has a prefill chunk run eagerly (no
mixed-step CUDA graphs), `:fuserope` with RoPE + the KV-cache write fused into decode attention
(KernelOptions.fuse_rotary_into_decode_attention), `:decodetable` with decode attention's launch
chosen by batch size (KernelOptions.decode_attention_tuning_by_batch: the table in --decode-tuning,
the JSON `gpu_kernels.py --decode-latency-sweep` writes, else DECODE_TABLE_GUESS); results get the
variant appended to their keys. Batch-1 decode, the switches off and on in one process:
  --parts int4,int4:fuserope,int4:decodetable,int4:fuserope:decodetable,decode,decode:fuserope:decodetable (The gate_up variants
that asked cuBLAS another way, measured in gpu_engine_gate_up_paths_h100.json, lost and are gone:
gpu_gemm.py keeps those paths.)
Writes $OUT/gpu_engine.json and prints a summary table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import time

import numpy as np
import torch

from goodserve import LLM, SamplingParams
# The offline batch's lengths, in the package so `goodserve calc batch` draws the same batch.
from goodserve.bench.workloads import offline_sharegpt_lengths as sharegpt_like_lengths
from goodserve.config import EngineConfig, KernelOptions
from goodserve.quant import linear

QKV_SHAPE = (6144, 4096)  # Llama-3.1-8B's qkv_proj (out_features, in_features): `cublasqkv`
# `decodetable` without --decode-tuning: batch 1 in one split up to 512 keys (written before any
# measurement: the H200's sweep had one split of 128 keys at 5.2 us against 7.9 for the default's 2 merged).
DECODE_TABLE_GUESS = {1: {"DIRECT_KEYS": 512}}
decode_table: dict[int, dict] = DECODE_TABLE_GUESS


def load_decode_table(path: str) -> dict[int, dict]:
    """gpu_kernels.py --decode-latency-sweep's decode_tuning_by_batch.json, keyed by batch size."""
    with open(path) as f:
        return {int(batch): tuning for batch, tuning in json.load(f).items()}


def variant_options(variants: list[str], max_num_batched_tokens: int) -> dict:
    """The engine options (LLM keywords) of a part's variants; no variant: the defaults."""
    defaults = EngineConfig()
    kernels = KernelOptions(
        pdl="nopdl" not in variants,
        cublas_linears=(QKV_SHAPE,) if "cublasqkv" in variants else (),
        decode_attention_waves=1 if "halvedsplits" in variants else defaults.kernels.decode_attention_waves,
        graph_time_tolerance=float("inf") if "smallestgraph" in variants else defaults.kernels.graph_time_tolerance,
        mixed_graph_max_tokens=0 if "nomixedgraphs" in variants else defaults.kernels.mixed_graph_max_tokens,
        decode_kernel_for_mixed_decodes="prefillonly" not in variants,
        fuse_rotary_into_decode_attention="fuserope" in variants,
        decode_attention_tuning_by_batch=decode_table if "decodetable" in variants else {})
    return {
        "kernels": kernels,
        "kv_cache_dtype": "fp8" if "kvfp8" in variants else "auto",
        "quantization": "fp8" if "fp8" in variants else None,
        "max_num_batched_tokens": next((int(v[1:]) for v in variants if v[0] == "t" and v[1:].isdigit()),
                                       max_num_batched_tokens),
        "scheduler_policy": "makespan" if "makespan" in variants else "continuous",
        "makespan_slack": next((float(v[5:]) for v in variants if v.startswith("slack")), defaults.makespan_slack),
        "makespan_min_admit": next((int(v[5:]) for v in variants if v.startswith("admit")),
                                   defaults.makespan_min_admit),
    }


PART_ALIASES = {"sharegpt_fp8": "sharegpt:fp8"}  # its keys get the variant's suffix: beside bf16's in one run
OUT = os.environ.get("OUT", "out")
results: dict = {}


def copy_bandwidth_gbps() -> float:
    from triton.testing import do_bench

    src = torch.randn(1 << 28, device="cuda")  # 1 GiB of float32
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def free_gpu() -> None:
    """Call after `del` of the last reference to an engine: its KV pool and graphs go back."""
    gc.collect()
    torch.cuda.empty_cache()


# ---- check ---------------------------------------------------------------------------------
def part_check(kernels: KernelOptions) -> None:
    """Random-weight models (the embedded GGUF is too large to carry to the GPU machine)."""
    rng = np.random.default_rng(5)
    prompts = [{"prompt_token_ids": rng.integers(100, 20000, n).tolist()} for n in (5, 40, 130, 300)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    results["check"] = {}
    for model in ("dummy:llama-3.2-1b", "dummy:qwen2.5-0.5b"):
        runs = {}
        for name, options in {
            "torch_eager_fp32": dict(attention_backend="torch", enforce_eager=True, dtype="float32"),
            "triton_eager_fp32": dict(attention_backend="triton", enforce_eager=True, dtype="float32"),
            "triton_graphs_fp32": dict(attention_backend="triton", dtype="float32"),
            "triton_graphs_chunked_fp32": dict(attention_backend="triton", dtype="float32",
                                               max_num_batched_tokens=64),
            "triton_graphs_bf16": dict(attention_backend="triton", dtype="bfloat16"),
        }.items():
            llm = LLM(model, device="cuda", max_num_seqs=8, kernels=kernels, **options)
            outputs = llm.generate(prompts, params)
            runs[name] = [(o.outputs[0].token_ids, [e[t].logprob for t, e in zip(o.outputs[0].token_ids,
                                                                                o.outputs[0].logprobs)])
                          for o in outputs]
            del llm
            free_gpu()
        reference = runs["torch_eager_fp32"]
        results["check"][model] = {
            name: {"tokens_identical_to_torch_fp32": [r[0] for r in run] == [r[0] for r in reference],
                   "first_divergence": [_first_diff(a[0], b[0]) for a, b in zip(run, reference)],
                   "max_abs_logprob_diff_first_token": max(abs(a[1][0] - b[1][0]) for a, b in zip(run, reference))}
            for name, run in runs.items()
        }


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


# ---- decode --------------------------------------------------------------------------------
def part_decode(bandwidth_gbps: float, model: str, quantization: str | None = None, int4_kernel: str = "",
                quantize_lm_head: bool | None = None, tag: str = "", device: str = "cuda",
                new_tokens: int = 256, kernels: KernelOptions = KernelOptions(),
                lm_head_quantization: str = "int8") -> None:
    """Batch-1 decode. Quantized runs quantize lm_head too (it is 1 GB of an 8B model's step; int8, or
    as lm_head_quantization says) unless quantize_lm_head says otherwise; tag is appended to the
    result's key (device "cpu" and fewer new_tokens: only gpu_int4.py's --smoke, to exercise the code)."""
    # "triton" / "tinygemm": that int4 kernel at every decode batch size; "": the engine's choice
    if int4_kernel:
        kernels = dataclasses.replace(kernels, int4_tinygemm_max_m={"triton": 0, "tinygemm": linear.CUDA_KERNEL_MAX_M}[
            int4_kernel])
    if quantize_lm_head is None:
        quantize_lm_head = quantization is not None
    llm = LLM(model, device=device, max_num_seqs=64, quantization=quantization, quantize_lm_head=quantize_lm_head,
              lm_head_quantization=lm_head_quantization, kernels=kernels)
    spec = llm.spec
    prompt = {"prompt_token_ids": list(np.random.default_rng(0).integers(100, 20000, 128))}
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=min(16, new_tokens), ignore_eos=True))  # warm-up
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        out = llm.generate(prompt, params)[0]
        elapsed = time.perf_counter() - start
        times = out.metrics.token_times
        decode_s = times[-1] - times[0]
        runs.append({"e2e_tok_s": new_tokens / elapsed, "decode_tok_s": (new_tokens - 1) / decode_s,
                     "ttft_ms": (out.metrics.first_token_time - out.metrics.arrival_time) * 1e3})
    best = max(runs, key=lambda r: r["decode_tok_s"])
    weight_bytes, read_bytes = _weight_bytes(llm.engine.executor.worker.runner.model)
    kv_bytes = spec.kv_bytes_per_token(2) * (128 + 128)  # mean context over the decode
    step_s = 1 / best["decode_tok_s"]
    name = "decode" if quantization is None else f"decode_{quantization}{'_' + int4_kernel if int4_kernel else ''}"
    results[name + tag] = {
        "model": model, "quantization": quantization, "quantize_lm_head": quantize_lm_head,
        "lm_head_quantization": lm_head_quantization if quantize_lm_head else None,
        "int4_kernel": int4_kernel or None, "runs": runs, "weight_bytes": weight_bytes,
        "step_read_bytes": read_bytes + kv_bytes,
        # the usual convention: every weight byte (the embedding table included) per token
        "bandwidth_limit_tok_s": bandwidth_gbps * 1e9 / (weight_bytes + kv_bytes),
        "mbu": (weight_bytes + kv_bytes) / step_s / (bandwidth_gbps * 1e9),
        # what a step really reads: one embedding row, not the table
        "bandwidth_limit_read_tok_s": bandwidth_gbps * 1e9 / (read_bytes + kv_bytes),
        "mbu_read": (read_bytes + kv_bytes) / step_s / (bandwidth_gbps * 1e9),
        "step_breakdown_s": _breakdown(llm),
    }
    del llm
    free_gpu()


def _weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(all weight bytes, bytes a decode step reads): parameters and buffers (quantized weights and
    scales live in buffers); a step reads one row of an untied embedding table, not all of it."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    tensors.pop(id(model.rotary_cache), None)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    embedding = model.model.embed_tokens.weight
    tied = any(t is embedding for t in (getattr(model.lm_head, "weight", None),))
    return total, total - (0 if tied else embedding.numel() * embedding.element_size())


def part_kv_quant(model: str, kernels: KernelOptions) -> None:
    """High concurrency, every output 180 tokens: INT8 KV against the model-dtype KV at equal memory."""
    inputs, _ = sharegpt_like_lengths(1000, seed=4)
    prompts = random_prompts(inputs, seed=5)
    for kv_dtype in ("auto", "int8"):
        llm = LLM(model, device="cuda", max_num_seqs=1024, max_num_batched_tokens=8192, kv_cache_dtype=kv_dtype,
                  gpu_memory_utilization=0.5, kernels=kernels)
        run = run_offline(llm, prompts, [180] * len(prompts))
        run["num_kv_blocks"] = llm.engine.kv.num_blocks
        run["num_preemptions"] = llm.engine.stats().num_preemptions
        results[f"kv_{kv_dtype}_1000_requests"] = run
        del llm
        free_gpu()


def _breakdown(llm: LLM) -> dict:
    stats = llm.engine.stats()
    return {"steps": stats.num_steps, "schedule": stats.schedule_seconds_total,
            "prepare": stats.prepare_seconds_total, "forward": stats.forward_seconds_total,
            "sample": stats.sample_seconds_total, "detokenize": stats.detokenize_seconds_total,
            "output": stats.output_seconds_total}


# ---- throughput ----------------------------------------------------------------------------
def random_prompts(lengths: list[int], seed: int = 1, vocab_size: int = 20000) -> list[dict]:
    """Token ids from 100 to 20000 (above the special and byte tokens), or within a smaller vocabulary."""
    rng = np.random.default_rng(seed)
    high = min(20000, vocab_size)
    return [{"prompt_token_ids": rng.integers(min(100, high // 2), high, n).tolist()} for n in lengths]


STEP_BUCKETS = ((1, 1), (2, 8), (9, 64), (65, 256), (257, 1 << 30))


def traced_steps(llm: LLM) -> list[tuple[int, int, float]]:
    """Records (sequences, tokens, seconds) of every engine step from now on."""
    trace, step = [], llm.engine.step

    def timed_step(*args, **kwargs):
        start = time.perf_counter()
        out = step(*args, **kwargs)
        stats = llm.engine.stats()
        trace.append((stats.last_batch_seqs, stats.last_batch_tokens, time.perf_counter() - start))
        return out

    llm.engine.step = timed_step
    return trace


def summarize_steps(trace: list[tuple[int, int, float]]) -> dict:
    """Where the time went: steps with prefill tokens, then decode-only steps by batch size."""
    groups: dict[str, list[float]] = {}
    for seqs, tokens, seconds in trace:
        if tokens > seqs:
            name = "with_prefill"
        else:
            name = next(f"decode_{lo}_{hi if hi < 1 << 30 else 'up'}" for lo, hi in STEP_BUCKETS if lo <= seqs <= hi)
        groups.setdefault(name, []).append(seconds)
    summary = {name: {"steps": len(t), "seconds": sum(t), "mean_ms": 1e3 * sum(t) / len(t)}
               for name, t in groups.items()}
    summary["prefill_steps"] = [(seqs, tokens, round(1e3 * s, 1)) for seqs, tokens, s in trace if tokens > seqs]
    return summary


def run_offline(llm: LLM, prompts: list[dict], output_lens: list[int]) -> dict:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate(prompts[:8], params[:8])  # warm-up
    trace = traced_steps(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    del llm.engine.step  # back to the class's method
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    return {"requests": len(prompts), "seconds": elapsed, "requests_per_s": len(prompts) / elapsed,
            "output_tok_s": out_tokens / elapsed, "total_tok_s": (in_tokens + out_tokens) / elapsed,
            "input_tokens": in_tokens, "output_tokens": out_tokens, "max_output_len": max(output_lens),
            "steps": summarize_steps(trace)}


def graph_choice(runner) -> dict:
    """Each graph's replay time at start-up, and the sizes whose batches replay a larger graph."""
    return {"graph_replay_ms": dict(runner.graphs.decode.replay_ms),
            "graph_replayed_instead": runner.graphs.decode.replaced(),
            "mixed_graph_replay_ms": dict(runner.graphs.mixed.replay_ms),
            "mixed_graph_replayed_instead": runner.graphs.mixed.replaced()}


def part_throughput(model: str, max_num_seqs: int, options: dict, only_sharegpt: bool = False) -> None:
    """options: the variant's engine options (variant_options)."""
    llm = LLM(model, device="cuda", max_num_seqs=max_num_seqs, **options)
    makespan = options["scheduler_policy"] == "makespan"
    results["throughput_config"] = {
        "max_num_seqs": max_num_seqs, **{key: options[key] for key in (
            "max_num_batched_tokens", "kv_cache_dtype", "quantization", "scheduler_policy",
            *(("makespan_slack", "makespan_min_admit") if makespan else ()))},
        **graph_choice(llm.engine.executor.worker.runner)}
    inputs, outputs = sharegpt_like_lengths(500)
    prompts = random_prompts(inputs)
    results["throughput_sharegpt_like"] = run_offline(llm, prompts, outputs)
    results["throughput_sharegpt_like"]["breakdown_s"] = _breakdown(llm)
    if only_sharegpt:
        del llm
        free_gpu()
        return
    results["throughput_fixed_180"] = run_offline(llm, prompts, [180] * len(prompts))
    results["throughput_breakdown_s"] = _breakdown(llm)
    rng = np.random.default_rng(2)
    nano_in, nano_out = rng.integers(100, 1025, 256).tolist(), rng.integers(100, 1025, 256).tolist()
    results["nano_vllm_workload"] = run_offline(llm, random_prompts(nano_in, 3), nano_out)
    del llm
    free_gpu()


def part_profile_mixed(model: str, max_num_seqs: int, options: dict) -> None:
    """Per-kernel CUDA time of the ShareGPT-like run's first steps, where prefill chunks and
    decodes share a batch."""
    from torch.profiler import ProfilerActivity, profile

    llm = LLM(model, device="cuda", max_num_seqs=max_num_seqs, **options)
    inputs, outputs = sharegpt_like_lengths(500)
    for i, (prompt, n) in enumerate(zip(random_prompts(inputs), outputs)):
        llm.engine.add_request(str(i), prompt["prompt_token_ids"], SamplingParams(max_tokens=n, ignore_eos=True))
    llm.engine.step()  # the first, prefill-only step compiles what the warm-up did not
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            llm.engine.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
    print(table)
    with open(os.path.join(OUT, "gpu_profile_mixed.txt"), "w") as f:
        f.write(table)
    del llm
    free_gpu()


def part_profile_sharegpt(model: str, max_num_seqs: int, options: dict) -> None:
    from torch.profiler import ProfilerActivity, profile

    llm = LLM(model, device="cuda", max_num_seqs=max_num_seqs, **options)
    inputs, outputs = sharegpt_like_lengths(500)
    prompts = random_prompts(inputs)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    llm.generate(prompts[:8], params[:8])  # warm-up
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - start
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    busy_us = sum(e.self_device_time_total for e in kernels)
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:40]
    results["profile_sharegpt"] = {
        "wall_s": wall, "kernel_busy_s": busy_us / 1e6,
        "kernels": [{"name": e.key[:90], "total_ms": e.self_device_time_total / 1e3, "calls": e.count,
                     "mean_us": e.self_device_time_total / max(e.count, 1)} for e in top]}
    for row in results["profile_sharegpt"]["kernels"]:
        print(f"{row['total_ms']:10.1f} ms {row['calls']:8d} {row['mean_us']:9.1f} us  {row['name']}")
    del llm
    free_gpu()


# ---- peer ----------------------------------------------------------------------------------
def part_peer(model: str, continuous_batching: bool = True) -> None:
    """HF transformers: generate() at batch 1, then (unless continuous_batching is False) generate_batch."""
    import transformers

    from goodserve.model.presets import get_preset

    spec = get_preset(model.removeprefix("dummy:"))
    config = transformers.LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, max_position_embeddings=8192, rope_theta=spec.rope_theta,
    )
    with torch.device("cuda"):
        hf = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    peer: dict = {"transformers": transformers.__version__}
    ids = torch.tensor([np.random.default_rng(0).integers(100, 20000, 128).tolist()], device="cuda")
    try:
        hf.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=256, min_new_tokens=256, do_sample=False)
        torch.cuda.synchronize()
        peer["hf_generate_batch1_tok_s"] = 256 / (time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - a peer failure is recorded, not fatal
        peer["hf_generate_error"] = repr(exc)
    if continuous_batching:
        try:
            inputs, _ = sharegpt_like_lengths(500)
            prompts = [p["prompt_token_ids"] for p in random_prompts(inputs)]
            hf.config._attn_implementation = "paged|sdpa"
            gen_config = transformers.GenerationConfig(max_new_tokens=180, do_sample=False, eos_token_id=-1,
                                                       pad_token_id=0)
            hf.generate_batch(inputs=prompts[:8], generation_config=gen_config)
            start = time.perf_counter()
            out = hf.generate_batch(inputs=prompts, generation_config=gen_config)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.generated_tokens) for o in out.values())
            peer["hf_generate_batch"] = {"requests_per_s": len(prompts) / elapsed, "output_tok_s": tokens / elapsed,
                                         "seconds": elapsed, "output_tokens": tokens}
        except Exception as exc:  # noqa: BLE001
            peer["hf_generate_batch_error"] = repr(exc)
    results["peer"] = peer
    del hf
    free_gpu()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="check,decode,throughput,peer")
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--decode-tuning", metavar="JSON", help="the `decodetable` variant's table (default: "
                        "DECODE_TABLE_GUESS): gpu_kernels.py --decode-latency-sweep's decode_tuning_by_batch.json")
    args = parser.parse_args()
    global decode_table
    if args.decode_tuning:
        decode_table = load_decode_table(args.decode_tuning)
    results["decode_table"] = decode_table
    os.makedirs(OUT, exist_ok=True)
    results["card"] = torch.cuda.get_device_name()
    results["torch"] = torch.__version__
    bandwidth = copy_bandwidth_gbps()
    results["copy_bandwidth_gbps"] = bandwidth
    for spec in args.parts.split(","):
        part, *variants = PART_ALIASES.get(spec, spec).split(":")
        start = time.perf_counter()
        earlier = dict(results)
        if variants:  # measured apart, then stored under suffixed keys
            results.clear()
        try:
            options = variant_options(variants, args.max_num_batched_tokens)
            kernels = options["kernels"]
            {"check": lambda: part_check(kernels),
             "decode": lambda: part_decode(bandwidth, args.model, kernels=kernels),
             "throughput": lambda: part_throughput(args.model, args.max_num_seqs, options),
             "sharegpt": lambda: part_throughput(args.model, args.max_num_seqs, options, only_sharegpt=True),
             "peer": lambda: part_peer(args.model),
             "profile_sharegpt": lambda: part_profile_sharegpt(args.model, args.max_num_seqs, options),
             "profile_mixed": lambda: part_profile_mixed(
                 args.model, args.max_num_seqs, {**options, "max_num_batched_tokens": args.max_num_batched_tokens}),
             "int8": lambda: part_decode(bandwidth, args.model, "int8", kernels=kernels),
             "decode_fp8": lambda: part_decode(bandwidth, args.model, "fp8", kernels=kernels),
             "decode_fp8_head16": lambda: part_decode(bandwidth, args.model, "fp8", quantize_lm_head=False,
                                                      tag="_head16", kernels=kernels),
             "int4": lambda: part_decode(bandwidth, args.model, "int4", kernels=kernels),
             "int4_triton": lambda: part_decode(bandwidth, args.model, "int4", "triton", kernels=kernels),
             "int4_tinygemm": lambda: part_decode(bandwidth, args.model, "int4", "tinygemm", kernels=kernels),
             "kvquant": lambda: part_kv_quant(args.model, kernels)}[part]()
        except Exception as exc:  # noqa: BLE001 - keep the other parts' numbers
            import traceback

            traceback.print_exc()
            results[f"{part}_error"] = repr(exc)
        if variants:
            measured = {"_".join([key, *variants]): value for key, value in results.items()}
            results.clear()
            results.update(earlier, **measured)
        print(f"[{spec}] {time.perf_counter() - start:.1f}s", flush=True)
        with open(os.path.join(OUT, "gpu_engine.json"), "w") as f:
            json.dump(results, f, indent=2)
    print(json.dumps(results, indent=1)[-6000:])


if __name__ == "__main__":
    main()
