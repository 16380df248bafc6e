"""Prefill attention: the Triton prefill kernel (its keys split over programs or not) against torch's
FlashAttention over K/V gathered from the pool (ops/flash_prefill.py), by chunk length and context;
then the engine's long-prompt and shared-prefix TTFT per engine variant (KernelOptions
split_prefill_attention and flash_prefill_min_tokens, the step's token budget).

  kernel  Llama-3.1-8B's heads (32 q, 8 KV, head dim 128), bf16, 16-token blocks: one sequence's
          chunk of L queries on C cached tokens through ops/attention.paged_attention (an eager
          launch): Triton as the engine launches it, Triton with one program a query block, and
          flash (its gather included); flash on K/V already contiguous and, for chunks without
          context, cuDNN's attention (heads repeated) as yardsticks. TFLOP/s count the causal half;
          rel_err: flash and the split kernel against the unsplit kernel.
  e2e     per variant, in a process of its own: gpu_peer_vllm.py's prefix part (a 4,096-token system
          prompt, 20-token questions: TTFT of a miss and of hits) and long part (32,768-token prompts).

    PYTHONPATH=src python3 benchmarks/gpu_prefill_attention.py [--parts kernel,e2e] \\
        [--variants '{"triton": {"kernels": {"flash_prefill_min_tokens": 0}}, "flash": {}}']

Writes $OUT/gpu_prefill_attention.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
OUT = os.environ.get("OUT", "/tmp/out")
# (queries, cached tokens before them)
KERNEL_CASES = [(256, 0), (512, 0), (1024, 0), (2048, 0), (4096, 0), (8192, 0), (512, 7680), (1024, 7168),
                (8192, 8192), (8192, 24576), (20, 4096), (20, 32768), (200, 4096)]
# Steps of 8,192 tokens (vLLM's chunk on an H100) run eagerly, so their chunks can reach flash; at the
# default 2,048 a chunk replays a mixed-step graph (the Triton kernel) whatever the threshold.
DEFAULT_VARIANTS = {
    "default": {},
    "unsplit": {"kernels": {"split_prefill_attention": False}},
    "triton_8k": {"max_num_batched_tokens": 8192, "kernels": {"flash_prefill_min_tokens": 0}},
    "flash_8k": {"max_num_batched_tokens": 8192},
}


def kernel_part() -> list[dict]:
    from gpu_kernels import BF16, D, HK, HQ, PDL, bench_ms, make_paged, rel_err

    from goodserve.config import KernelOptions
    from goodserve.ops.attention import gather_kv, paged_attention
    from goodserve.ops.flash_prefill import flash_prefill
    from goodserve.ops.kernel_choice import KernelChoice

    def choice(min_tokens: int, split: bool = True) -> KernelChoice:
        return KernelChoice(triton=True, pdl=PDL, options=KernelOptions(flash_prefill_min_tokens=min_tokens,
                                                                        split_prefill_attention=split))

    rows = []
    for queries, context in KERNEL_CASES:
        seq_len = queries + context
        q, cache, meta = make_paged(1, [queries], [seq_len], BF16, seed=queries + context)
        scale = D**-0.5
        unsplit_out = paged_attention(q.clone(), cache, meta, scale, choice(0, split=False))
        triton_out = paged_attention(q.clone(), cache, meta, scale, choice(0))
        flash_out = paged_attention(q.clone(), cache, meta, scale, choice(1))
        key, value = gather_kv(cache, meta.block_tables[0, : -(-seq_len // 16)].long(), seq_len, BF16)
        flops = 4 * HQ * D * (queries * context + queries * (queries + 1) // 2)
        row = {"queries": queries, "context": context, "flops": flops,
               "triton_ms": bench_ms(lambda: paged_attention(q, cache, meta, scale, choice(0))),
               "triton_unsplit_ms": bench_ms(lambda: paged_attention(q, cache, meta, scale, choice(0, split=False))),
               "flash_ms": bench_ms(lambda: paged_attention(q, cache, meta, scale, choice(1))),
               "flash_contiguous_ms": bench_ms(lambda: flash_prefill(q, key, value, scale)),
               "flash_vs_triton_rel_err": rel_err(flash_out, unsplit_out),
               "split_vs_unsplit_rel_err": rel_err(triton_out, unsplit_out)}
        if context == 0:
            row["cudnn_ms"] = cudnn_ms(q, key, value, scale, bench_ms)
        for name in ("triton", "triton_unsplit", "flash", "flash_contiguous", "cudnn"):
            if row.get(f"{name}_ms"):
                row[f"{name}_tflops"] = flops / (row[f"{name}_ms"] * 1e-3) / 1e12
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def cudnn_ms(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, bench_ms) -> float | None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // key.shape[1]
    args = [t.transpose(0, 1).unsqueeze(0) for t in (q, key.repeat_interleave(group, 1),
                                                      value.repeat_interleave(group, 1))]
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(*args, is_causal=True,
                                                                                     scale=scale))
    except RuntimeError as error:
        print(f"cudnn: {error}", flush=True)
        return None


def e2e_variant(engine_args: dict) -> dict:
    import gpu_peer_vllm as peer

    from goodserve.config import KernelOptions

    kernels = KernelOptions(**engine_args.get("kernels", {}))
    engine = peer.GoodserveEngine(peer.GOODSERVE_MODEL, "cuda", **{**engine_args, "kernels": kernels})
    prompts, sizes = peer.Prompts(engine.vocab_size), peer.Sizes()
    engine.generate([prompts.ids(128)], [16])  # warm-up
    return {"engine_args": engine_args, "flash_prefill_min_tokens": kernels.flash_prefill_min_tokens,
            "prefix": peer.measure_prefix(engine, prompts, sizes), "long": peer.measure_long(engine, prompts, sizes)}


def e2e_part(variants: dict) -> dict:
    results = {}
    for name, engine_args in variants.items():
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        log = os.path.join(OUT, f"gpu_prefill_attention_{name}.log")
        with open(log, "w") as out:
            code = subprocess.run([sys.executable, __file__, "--child", json.dumps(engine_args), "--json", path],
                                  stdout=out, stderr=subprocess.STDOUT).returncode
        results[name] = json.load(open(path)) if code == 0 else {"error": f"exit {code}, see {log}"}
        run = results[name]
        if "error" not in run:
            print(f"{name}: prefix miss {run['prefix']['median_miss_ttft_ms']:.1f} ms, hit "
                  f"{run['prefix']['median_hit_ttft_ms']:.1f} ms; 32K TTFT {run['long']['median_ttft_ms']:.0f} ms",
                  flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="kernel,e2e")
    parser.add_argument("--variants", default=json.dumps(DEFAULT_VARIANTS),
                        help="JSON: name -> LLM keyword arguments (\"kernels\": KernelOptions fields), each an "
                             "engine in a process of its own")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        json.dump(e2e_variant(json.loads(args.child)), open(args.json, "w"))
        return
    from result_file import gpu_names

    os.makedirs(OUT, exist_ok=True)
    parts = args.parts.split(",")
    report = {"card": gpu_names(), "torch": torch.__version__}
    if "kernel" in parts:
        report["kernel"] = kernel_part()
    if "e2e" in parts:
        report["e2e"] = e2e_part(json.loads(args.variants))
    json.dump(report, open(os.path.join(OUT, "gpu_prefill_attention.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
