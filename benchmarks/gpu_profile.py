"""Where a step's time goes: torch.profiler over decode steps (and, with --mixed-prompt, over the
step that takes a prompt beside them), printed as a table of the kernels with the most device time,
then the engine's own per-stage host timings per step.

With --breakdown, each variant (--variants) runs in a process of its own and writes a JSON summary:
per step, the device time by category (GEMMs, attention, norms, activations, sampling, copies,
other small kernels), the GPU's idle time between kernels (host gaps: the wall time the device
waited for the host), the unprofiled step time, and the roofline bound of a decode step (weights +
KV bytes at the measured copy bandwidth, FLOPs at the measured bf16 matmul rate; and the sum of each
GEMM's own bound and attention's KV bytes) with the step's ratio to it.

Eager by default (no CUDA graph, so each kernel's launch is visible too); --graphs profiles the
captured graphs, as the engine runs them (CUPTI still times each kernel inside a graph).

    python benchmarks/gpu_profile.py [--model dummy:llama-3.1-8b] [--batch 1] [--context 256] [--graphs] [--nopdl]
                                     [--quantization int4 [--quantize-lm-head]]
    python benchmarks/gpu_profile.py --batch 256 --graphs --breakdown --mixed-prompt 1024 \\
        [--variants '{"default": {}, "no_rotary_fusion": {"kernels": {"fuse_rotary_into_decode_attention": false}}}']
    python benchmarks/gpu_profile.py --device cpu --model smollm2-135m   # a CPU smoke run

A variant is LLM keyword arguments, its "kernels" entry KernelOptions fields, and "src" (optional)
another checkout's src/ to import goodserve from (`git archive COMMIT src | tar -x -C DIR`). Writes
$OUT/gpu_profile_b{batch}_ctx{context}[...].txt, and with --breakdown the same name in .json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from goodserve import LLM, SamplingParams
from goodserve.config import KernelOptions
from result_file import gpu_names

STAGES = ("schedule", "prepare", "forward", "sample", "detokenize", "output")
PROFILED_STEPS = 8

# Kernel name -> category, first match wins: cuBLAS (nvjet, sm90_xmma, cutlass) and the project's
# GEMV/quantized kernels; the Triton attention kernels (RoPE + KV write included); the fused norms
# and activations; the sampler's kernels; copies (the inputs' upload, the logits' float conversion);
# everything else (torch's other elementwise kernels, the embedding lookup, the logits' gather).
CATEGORIES = (
    ("gemm", r"gemm|gemv|nvjet|xmma|cutlass|cublas|_int4_|_int8_|splitk|matmul"),
    ("attention", r"_decode_kernel|_prefill_kernel|_rotary_write_kv|attention|flash|fmha"),
    ("norm", r"rms_norm"),
    ("activation", r"silu|gelu"),
    ("sampling", r"argmax|exponential|sort|softmax|topk|top_k|multinomial|cumsum|bitmask|distribution"),
    ("copy", r"memcpy|memset|copy"),
)


def kernel_category(name: str) -> str:
    lowered = name.lower()
    return next((category for category, pattern in CATEGORIES if re.search(pattern, lowered)), "other")


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals: the time the device ran anything."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def device_breakdown(prof, wall_s: float, steps: int) -> dict:
    """Per step, ms: each category's device time, the time the device ran anything, and its idle
    time within the profiled window's wall time (host gaps). Under programmatic dependent launch a
    Triton kernel starts before the one it follows ends and waits: the categories' sum exceeds the
    busy time by that overlap (a variant with {"kernels": {"pdl": false}} times each kernel alone)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.load(open(trace.name))["traceEvents"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    by_category: dict[str, float] = {}
    by_kernel: dict[str, list] = {}
    for e in kernels:
        category = kernel_category(e["name"])
        by_category[category] = by_category.get(category, 0.0) + e["dur"]
        entry = by_kernel.setdefault(e["name"][:100], [category, 0.0, 0])
        entry[1] += e["dur"]
        entry[2] += 1
    busy = busy_us([(e["ts"], e["ts"] + e["dur"]) for e in kernels]) / 1e3 / steps
    wall = 1e3 * wall_s / steps
    top = sorted(by_kernel.items(), key=lambda item: -item[1][1])[:25]
    return {"wall_ms": wall, "busy_ms": busy, "host_gap_ms": max(wall - busy, 0.0),
            "overlap_ms": sum(by_category.values()) / 1e3 / steps - busy,
            "category_ms": {c: us / 1e3 / steps for c, us in sorted(by_category.items(), key=lambda i: -i[1])},
            "top_kernels": [{"name": name, "category": c, "ms_per_step": us / 1e3 / steps, "calls_per_step": n / steps}
                            for name, (c, us, n) in top]}


def profiled(engine, steps: int, device: str, host_ops: bool):
    """(profiler, wall seconds) over `steps` engine steps, the device synchronized at both ends.
    host_ops: record the host's torch ops too (for the table); their recording slows the host, so
    the breakdown's host gaps are measured without."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    activities = ([ProfilerActivity.CPU] if host_ops or not cuda else []) + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
    return prof, wall


def host_breakdown(engine, steps: int = 50) -> dict:
    """Per-step milliseconds of each engine stage over `steps` unprofiled steps, and the wall time."""
    before = engine.stats()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - started) / steps * 1e3
    after = engine.stats()
    per_step = {s: (getattr(after, f"{s}_seconds_total") - getattr(before, f"{s}_seconds_total")) / steps * 1e3
                for s in STAGES}
    return {"wall_ms": wall, **per_step}


def host_line(per_step: dict, steps: int) -> str:
    parts = ", ".join(f"{s} {per_step[s]:.3f}" for s in STAGES)
    return (f"per decode step over {steps} steps (ms): wall {per_step['wall_ms']:.3f}; {parts} "
            "(forward includes the GPU wait)")


# ---- the roofline of a decode step ---------------------------------------------------------------
def measured_rates() -> dict:
    """The card's device-to-device copy bandwidth and dense bf16 matmul rate, as measured now."""
    from triton.testing import do_bench

    src = torch.randn(1 << 28, device="cuda")  # 1 GiB of float32
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    del src, dst
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    matmul_ms = do_bench(lambda: a @ b, warmup=10, rep=50, return_mode="median")
    return {"copy_gbps": 2 * (1 << 28) * 4 / (copy_ms * 1e-3) / 1e9,
            "matmul_tflops": 2 * n**3 / (matmul_ms * 1e-3) / 1e12}


def decode_roofline(model, rows: int, context: int, rates: dict, kv_bytes_per_token: int) -> dict:
    """A decode step of `rows` sequences at `context` tokens each: its bytes (every weight but the
    embedding table, whose rows alone are read; each sequence's KV) and FLOPs (2 per weight and row;
    4 per head dimension, key and row in attention), bound by the rates. The per-op bound adds each
    GEMM's own max(bytes, FLOPs) time and attention's KV bytes: they do not overlap."""
    bw, flop_rate = rates["copy_gbps"] * 1e9, rates["matmul_tflops"] * 1e12
    shapes = [(m.in_features * m.out_features, _own_bytes(m)) for m in _linears(model)]
    weight_bytes = sum(nbytes for _, nbytes in shapes)
    weight_flops = sum(2 * rows * numel for numel, _ in shapes)
    gemm_bound_s = sum(max(nbytes / bw, 2 * rows * numel / flop_rate) for numel, nbytes in shapes)
    spec = model.spec
    kv_bytes = rows * context * kv_bytes_per_token
    attention_flops = 4 * rows * context * spec.num_heads * spec.head_dim * spec.num_layers
    bytes_ms, flops_ms = 1e3 * (weight_bytes + kv_bytes) / bw, 1e3 * (weight_flops + attention_flops) / flop_rate
    return {"rows": rows, "context": context, "weight_gb": weight_bytes / 1e9, "kv_gb": kv_bytes / 1e9,
            "tflop": (weight_flops + attention_flops) / 1e12, "bytes_ms": bytes_ms, "flops_ms": flops_ms,
            "roofline_ms": max(bytes_ms, flops_ms),
            "per_op_bound_ms": 1e3 * (gemm_bound_s + kv_bytes / bw), "gemm_bound_ms": 1e3 * gemm_bound_s,
            "attention_bound_ms": 1e3 * kv_bytes / bw}


def _linears(model) -> list[torch.nn.Module]:
    """The model's linear layers, whatever class holds them (nn.Linear, the GEMV-routed and the
    quantized ones): the modules with in and out features none of whose children has them."""
    def is_linear(m):
        return hasattr(m, "in_features") and hasattr(m, "out_features")
    return [m for m in model.modules() if is_linear(m) and not any(is_linear(c) for c in m.children())]


def _own_bytes(module: torch.nn.Module) -> int:
    """A linear's weight bytes: its parameters and buffers (quantized codes and scales)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def kv_bytes_per_token(runner) -> int:
    """K and V of one token in every layer, scales included, as the cache holds them."""
    total = 0
    for cache in runner.kv_caches:
        for tensor in (t for t in vars(cache).values() if isinstance(t, torch.Tensor)):
            total += tensor.numel() * tensor.element_size()
    return total // (runner.kv_caches[0].k.shape[0] * runner.block_size)


# ---- one run ---------------------------------------------------------------------------------
def build(args, variant: dict) -> LLM:
    variant = dict(variant)
    variant.pop("src", None)  # the child's PYTHONPATH took it
    options = {"pdl": not args.nopdl} | variant.pop("kernels", {})
    extra = args.mixed_prompt > 0
    return LLM(args.model, device=args.device, enforce_eager=not args.graphs,
               max_num_seqs=variant.pop("max_num_seqs", max(8, args.batch + extra)),
               kernels=KernelOptions(**options), quantization=args.quantization,
               quantize_lm_head=args.quantize_lm_head, **variant)


def start_decoding(engine, batch: int, context: int) -> None:
    """`batch` sequences of `context`-token prompts, stepped until every one decodes."""
    rng = np.random.default_rng(0)
    for i in range(batch):
        engine.add_request(f"r{i}", rng.integers(1, min(20000, engine.spec.vocab_size), context).tolist(),
                           SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    while engine.stats().last_batch_tokens != batch:  # prefill (in chunks) until every sequence decodes
        engine.step()
    for _ in range(3):  # warm-up
        engine.step()


def run(args, variant: dict) -> tuple[str, dict]:
    cuda = args.device.startswith("cuda")
    result: dict = {}
    if args.breakdown and cuda:  # before the engine sizes its KV pool from the free memory
        result["rates"] = measured_rates()
        torch.cuda.empty_cache()
    llm = build(args, variant)
    engine = llm.engine
    start_decoding(engine, args.batch, args.context)
    prof, wall = profiled(engine, PROFILED_STEPS if args.breakdown else 5, args.device, not args.breakdown)
    # under --breakdown the JSON's top kernels stand for the table (no host ops were recorded)
    table = "" if args.breakdown else prof.key_averages().table(
        sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=25, max_name_column_width=60)
    host = host_breakdown(engine)
    table += "\n" + host_line(host, 50)
    if args.breakdown and cuda:
        result["decode"] = device_breakdown(prof, wall, PROFILED_STEPS) | {"unprofiled": host}
        runner = engine.executor.worker.runner
        # the unprofiled steps' mean context: the prompt, then the tokens of every step before their middle
        context = args.context + 3 + PROFILED_STEPS + 50 // 2
        roofline = decode_roofline(runner.model, args.batch, context, result["rates"], kv_bytes_per_token(runner))
        roofline["step_over_roofline"] = host["wall_ms"] / roofline["roofline_ms"]
        roofline["step_over_per_op_bound"] = host["wall_ms"] / roofline["per_op_bound_ms"]
        # each of the two large categories against its own bound (profiled at a slightly shorter context)
        measured = result["decode"]["category_ms"]
        for category in ("gemm", "attention"):
            roofline[f"{category}_over_bound"] = measured.get(category, 0.0) / roofline[f"{category}_bound_ms"]
        result["roofline"] = roofline
        if args.mixed_prompt:
            result["mixed"] = mixed_step(engine, args)
    return table, result


def mixed_step(engine, args) -> dict:
    """The steps that take one more request's prompt (--mixed-prompt tokens, in chunks of the step's
    token budget) beside the decodes, profiled until its first token is out."""
    rng = np.random.default_rng(1)
    engine.add_request("mixed", rng.integers(1, min(20000, engine.spec.vocab_size), args.mixed_prompt).tolist(),
                       SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    tokens_before = engine.stats().step_tokens_total
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        for steps in range(1, 65):  # bounded: a profile, not a hang, whatever the scheduler does
            if any(output.request_id == "mixed" and output.outputs[0].token_ids for output in engine.step()):
                break
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    return device_breakdown(prof, wall, steps) | {
        "steps": steps, "prompt_tokens": args.mixed_prompt,
        "tokens_per_step": (engine.stats().step_tokens_total - tokens_before) / steps}


def summary_lines(name: str, result: dict) -> list[str]:
    lines = []
    for window in ("decode", "mixed"):
        if window not in result:
            continue
        r = result[window]
        shares = ", ".join(f"{c} {ms:.2f}" for c, ms in r["category_ms"].items())
        lines.append(f"{name} {window}: {r['wall_ms']:.2f} ms a step profiled, device busy {r['busy_ms']:.2f}, "
                     f"host gaps {r['host_gap_ms']:.2f}, kernels overlapping {r['overlap_ms']:.2f}; "
                     f"by category (ms): {shares}")
    if "roofline" in result:
        r, rates = result["roofline"], result["rates"]
        lines.append(f"{name} roofline at {r['rows']} rows x {r['context']} tokens: bytes {r['bytes_ms']:.2f} ms "
                     f"({r['weight_gb']:.1f} GB weights + {r['kv_gb']:.1f} GB KV at {rates['copy_gbps']:.0f} GB/s), "
                     f"FLOPs {r['flops_ms']:.2f} ms ({r['tflop']:.2f} TFLOP at {rates['matmul_tflops']:.0f} TFLOP/s); "
                     f"per-op bound {r['per_op_bound_ms']:.2f} ms; unprofiled step "
                     f"{result['decode']['unprofiled']['wall_ms']:.2f} ms = {r['step_over_roofline']:.2f}x the "
                     f"roofline, {r['step_over_per_op_bound']:.2f}x the per-op bound; GEMMs "
                     f"{r['gemm_over_bound']:.2f}x theirs ({r['gemm_bound_ms']:.2f} ms), attention "
                     f"{r['attention_over_bound']:.2f}x its KV bytes' ({r['attention_bound_ms']:.2f} ms)")
    return lines


def output_name(args) -> str:
    return (f"gpu_profile_b{args.batch}_ctx{args.context}{'_graphs' if args.graphs else ''}"
            f"{'_' + args.quantization if args.quantization else ''}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--graphs", action="store_true", help="replay CUDA graphs, as the engine does by default")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--nopdl", action="store_true",
                        help="programmatic dependent launch off, so a kernel's time excludes waiting for the one before")
    parser.add_argument("--quantization", help="weight-only quantization of the model (int8, int4, ...)")
    parser.add_argument("--quantize-lm-head", action="store_true", help="with --quantization: lm_head too")
    parser.add_argument("--breakdown", action="store_true",
                        help="the JSON breakdown by category, host gaps and the roofline, per variant")
    parser.add_argument("--mixed-prompt", type=int, default=0,
                        help="with --breakdown: also profile the steps that take a prompt of this many tokens")
    parser.add_argument("--variants", default='{"default": {}}',
                        help='JSON: name -> LLM keyword arguments ("kernels": KernelOptions fields), each run '
                             "in a process of its own, in the order given")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    variants = json.loads(args.variants)
    if args.child is not None:
        table, result = run(args, variants[args.child])
        with open(os.path.join(out, f"{output_name(args)}_{args.child}.txt"), "w") as f:
            f.write(table)
        print(json.dumps(result))
        return
    if not args.breakdown:
        table, _ = run(args, variants[next(iter(variants))])
        with open(os.path.join(out, output_name(args) + ".txt"), "w") as f:
            f.write(table)
        print(table)
        return
    summary: dict = {"card": gpu_names() or args.device,
                     "args": vars(args), "variants": {}}
    for name, variant in variants.items():
        env = dict(os.environ)
        if "src" in variant:  # this variant imports goodserve from another checkout's src/
            env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(variant["src"]), env.get("PYTHONPATH", "")])
        done = subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", name],
                              capture_output=True, text=True, env=env)
        if done.returncode != 0:
            summary["variants"][name] = {"error": done.stderr[-3000:]}
            print(f"{name} failed:\n{done.stderr[-3000:]}", flush=True)
            continue
        summary["variants"][name] = result = json.loads(done.stdout.splitlines()[-1])
        print("\n".join(summary_lines(name, result)), flush=True)
        with open(os.path.join(out, output_name(args) + ".json"), "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
