"""Mixture of experts on the GPU: the fused MoE kernel (quant/triton_moe.py) and a Qwen3-30B-A3B-shaped
dummy model's decode against its bandwidth limit, beside a dense 8B, in one call; and a Mixtral-8x7B
shaped one in int8 (93 GB in bf16: it fits an 80 GB card only so).

Correctness is the GPU gate's (tests/gpu/test_gpu_families.py); speed is here.
Parts (--parts, default kernel,decode,throughput; in this order, one process):
  kernel      the fused MoE alone at Qwen3-30B-A3B's shapes (hidden 2048, 128 experts of 768 columns,
              top 8), bf16, for 1, 2, 4, 8, 64 and 512 tokens (random routing): microseconds per call
              (CUDA graph of back-to-back calls, median) of both paths, forced (grouped_us: sort and
              grouped GEMMs; gemv_us: one GEMV per (token, slot) pair), and fused_us, the one the
              engine picks (engine_path, quant/triton_moe.moe_kernel_for); for each, the share of the
              copy bandwidth that reading the routed experts' weights once takes (1 token: 8 experts,
              75.5 MB; share_of_copy_bandwidth is fused_us's, grouped_share / gemv_share the
              paths'); beside them the torch path (a loop over the routed experts, host-synchronizing).
              Where the engine takes the GEMV path, also gemv_down_slots_<s>_us (the down launch with
              s of a token's slots a program, gemv_us being the default's) and the router launch
              (router_one_launch_us) beside the router's linear then the routing kernel
  decode      batch-1 decode, 128-token prompt, 256 tokens (gpu_engine.part_decode, best of 3) of
              dummy:qwen3-30b-a3b, then dummy:qwen3-8b and dummy:llama-3.1-8b (--decode-presets); for the MoE the
              bandwidth limit counts the bytes a token reads: attention, norms, router and lm_head,
              its 8 routed experts a layer (not the other 120), one embedding row, the KV cache;
              --decode-variants: further runs with other KernelOptions (decode_variants), of the
              MoE or of --variant-presets
  grouped-sweep
              the grouped path alone (sort, both grouped GEMMs) at Qwen3-30B-A3B's shapes, bf16, for 16 to
              2,048 tokens (random routing): microseconds per call of each candidate GroupedTiles
              (quant/triton_moe.py) beside grouped_tiles_for's, and the fastest (not in the default parts)
  pair-sweep  the GEMV path's two launches alone (gate | up; SwiGLU, down and the sum over slots) at
              Qwen3-30B-A3B's shapes, bf16, for 1, 2, 4 and 8 tokens: microseconds per launch of each
              candidate PairTiles (quant/triton_moe.py) beside pair_tiles_for's, and the fastest
              (not in the default parts)
  throughput  500 requests with ShareGPT-like lengths (gpu_engine's workload), offline, output tok/s,
              for dummy:qwen3-30b-a3b and dummy:qwen3-8b
  int8        batch-1 decode as `decode` of dummy:mixtral-8x7b with --quantization int8 (experts
              quantized per output row while loading, attention and lm_head int8 too, ~47 GB): the
              bandwidth limit counts its 2 routed experts of 8 a layer in int8 with their scales,
              attention, router, norms, lm_head, one embedding row and the KV cache
              (not in the default parts: --parts int8)
  int4        the same in int4 (groups of 128, ~26 GB; the kernel dequantizes in its tile)
What to read: decode.qwen3-30b-a3b.mbu_active (the target: >= 0.60) and its tok/s beside the
dense 8B's; kernel.tokens_1.share_of_copy_bandwidth says whether the kernel or the rest of the step
holds decode back, and grouped_us beside gemv_us by token count where quant/triton_moe.py's
GEMV_MAX_PAIRS belongs; decode_int8.mixtral-8x7b.decode_tok_s and mbu_active for the int8 MoE.
Writes $OUT/gpu_moe.json.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

import torch
from triton.runtime.errors import OutOfResources

import gpu_engine
from gpu_engine import copy_bandwidth_gbps, free_gpu, random_prompts, run_offline, sharegpt_like_lengths
from goodserve import LLM
from goodserve.config import KernelOptions
from goodserve.model.presets import get_preset
from goodserve.ops.kernel_choice import TORCH_KERNELS, KernelChoice
from goodserve.quant.moe import moe_torch, route
from goodserve.quant import triton_moe
from goodserve.quant.triton_moe import (GroupedTiles, PairTiles, grouped_tiles_for, moe_kernel_for, pair_tiles_for,
                                         triton_fused_moe, triton_route, triton_router)
from result_file import write_result

results: dict = {}
# The kernel part's token counts: decode at batch 1, 2, 4 and 8 (top 8: 64 pairs, GEMV_MAX_PAIRS), where
# the per-pair GEMV runs, then 64 tokens (the first measured past it, where the two paths cross) and a prefill.
KERNEL_TOKENS = (1, 2, 4, 8, 64, 512)
# The decode path's down launch, slots of a token a program takes (gemv_us is the default's).
DOWN_SLOTS = (2, 4, 8)
# The grouped sweep's token counts: from past the GEMV path (8 tokens, top 8) to a prefill chunk.
SWEEP_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048)
# The pair sweep's token counts: the decode batches whose pairs take the GEMV path (top 8: up to 8 tokens).
PAIR_SWEEP_TOKENS = (1, 2, 4, 8)
SHARED_MEMORY_BYTES = 227 * 1024  # a block's most on sm_90
INT4_GROUP = 128  # the engine's choice for Mixtral-8x7B's widths (the largest that divides them)


def _time_us(fn, rep_ms: int = 200) -> float:
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3


def _expert_stacks(spec) -> tuple[torch.Tensor, torch.Tensor]:
    e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    return (torch.randn(e * 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02,
            torch.randn(e * h, i, device="cuda", dtype=torch.bfloat16) * 0.02)


def part_kernel(bandwidth_gbps: float) -> None:
    spec = get_preset("qwen3-30b-a3b")
    e, h, k = spec.num_experts, spec.hidden_size, spec.num_experts_per_tok
    w13, w2 = _expert_stacks(spec)
    router = torch.randn(e, h, device="cuda", dtype=torch.bfloat16) * 0.02
    kernels = KernelChoice(triton=True)
    for tokens in KERNEL_TOKENS:
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
        weights, ids = route(torch.randn(tokens, e, device="cuda"), k, renormalize=True)
        row = {"engine_path": moe_kernel_for(ids.numel(), w13, w2)}
        for path in ("grouped", "gemv"):
            row[f"{path}_us"] = _time_us(lambda: triton_fused_moe(x, w13, w2, weights, ids, kernels, path=path))
        row["fused_us"] = row[f"{row['engine_path']}_us"]
        if row["engine_path"] == "gemv":
            for slots in DOWN_SLOTS:  # gemv_us: quant/triton_moe.DOWN_SLOTS_PER_PROGRAM's
                row[f"gemv_down_slots_{slots}_us"] = _time_us(
                    lambda: triton_fused_moe(x, w13, w2, weights, ids, kernels, path="gemv", down_slots=slots))
            row["router_one_launch_us"] = _time_us(lambda: triton_router(x, router, k, True))
            row["router_linear_then_route_us"] = _time_us(lambda: triton_route(x @ router.T, k, True))
        start = time.perf_counter()
        for _ in range(20):
            moe_torch(x, w13, w2, weights, ids, TORCH_KERNELS)
        torch.cuda.synchronize()
        row["torch_loop_us"] = (time.perf_counter() - start) / 20 * 1e6
        read = ids.unique().numel() * spec.expert_params() * 2  # each routed expert's weights once
        floor_us = read / (bandwidth_gbps * 1e3)
        row |= {"expert_bytes_read": read, "floor_us": floor_us, "share_of_copy_bandwidth": floor_us / row["fused_us"],
                "grouped_share": floor_us / row["grouped_us"], "gemv_share": floor_us / row["gemv_us"]}
        results.setdefault("kernel", {})[f"tokens_{tokens}"] = row


def sweep_candidates(pairs_per_expert: float):
    """Tiles to try: BLOCK_M up to twice an expert's mean pairs (16 at least: wider blocks would be
    padding), the pipeline's stages within a block's shared memory."""
    for block_m in (16, 32, 64, 128):
        if block_m > max(16, 2 * pairs_per_expert):
            continue
        for block_n in (64, 128, 256):
            for block_k in (64, 128):
                for warps, stages in ((4, 3), (8, 3), (8, 4)):
                    if stages * (block_m + block_n) * block_k * 2 <= SHARED_MEMORY_BYTES:
                        yield GroupedTiles(block_m, block_n, block_k, warps, stages)


def part_grouped_sweep() -> None:
    spec = get_preset("qwen3-30b-a3b")
    w13, w2 = _expert_stacks(spec)
    kernels = KernelChoice(triton=True)
    for tokens in SWEEP_TOKENS:
        x = torch.randn(tokens, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
        weights, ids = route(torch.randn(tokens, spec.num_experts, device="cuda"), spec.num_experts_per_tok, True)

        def time_tiles(tiles: GroupedTiles) -> float:  # a shorter window: hundreds of candidates in one call
            return _time_us(lambda: triton_fused_moe(x, w13, w2, weights, ids, kernels, path="grouped", tiles=tiles),
                            rep_ms=50)

        default = grouped_tiles_for(ids.numel())
        timed = []
        for tiles in sweep_candidates(ids.numel() / spec.num_experts):
            try:
                timed.append((time_tiles(tiles), tiles))
            except OutOfResources:  # registers or shared memory past the card's
                continue
        best_us, best = min(timed, key=lambda pair: pair[0])
        results.setdefault("grouped_sweep", {})[f"tokens_{tokens}"] = {
            "default": asdict(default), "default_us": time_tiles(default), "best": asdict(best), "best_us": best_us,
            "candidates": [asdict(tiles) | {"us": us} for us, tiles in timed]}


def pair_sweep_candidates(down: bool, top_k: int):
    """The GEMV path's tiles to try: ops/triton_gemv's one-row sweep's range; the down launch also by its
    slots a program (those of 1, 2, 4 that divide top k)."""
    for block_n in (8, 16, 32):
        for block_k in (128, 256, 512):
            for warps in (2, 4, 8):
                for slots in ([s for s in (1, 2, 4) if top_k % s == 0] if down else [None]):
                    yield PairTiles(block_n, block_k, warps, slots)


def part_pair_sweep() -> None:
    """Each launch of the GEMV path (gate | up, then down) timed alone at each candidate PairTiles, by
    token count, beside the tiles pair_tiles_for picks (current)."""
    spec = get_preset("qwen3-30b-a3b")
    h, i, e = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    w13, w2 = _expert_stacks(spec)
    for tokens in PAIR_SWEEP_TOKENS:
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
        weights, ids = route(torch.randn(tokens, e, device="cuda"), spec.num_experts_per_tok, True)
        gate_up = torch.randn(ids.numel(), 2 * i, device="cuda", dtype=torch.bfloat16)
        flat_ids = ids.reshape(-1)
        launches = {  # name -> (stack, K, a launch at given tiles)
            "gate_up": (w13, h, lambda t: triton_moe._pair_gemv(x, w13, e, gate_up, flat_ids, ids.shape[1], t)),
            "down": (w2, i, lambda t: triton_moe._down_sum(gate_up, w2, h, weights, ids, t))}
        row = {}
        for name, (stack, k, launch) in launches.items():
            timed = []
            for tiles in pair_sweep_candidates(name == "down", ids.shape[1]):
                try:
                    timed.append((_time_us(lambda: launch(tiles), rep_ms=50), tiles))
                except OutOfResources:
                    continue
            current = pair_tiles_for(stack, k)
            best_us, best = min(timed, key=lambda pair: pair[0])
            row[name] = {"current": asdict(current), "current_us": _time_us(lambda: launch(current), rep_ms=50),
                         "best": asdict(best), "best_us": best_us,
                         "candidates": [asdict(tiles) | {"us": us} for us, tiles in timed]}
        results.setdefault("pair_sweep", {})[f"tokens_{tokens}"] = row


def expert_bytes(spec, quantization: str | None) -> int:
    """One expert's bytes in one layer: bf16; int8 codes with a float32 scale per output row; int4
    codes with a float32 scale and zero per group of INT4_GROUP (model/moe.py QuantizedExperts)."""
    if quantization == "int8":
        return spec.expert_params() + (2 * spec.moe_intermediate_size + spec.hidden_size) * 4
    if quantization == "int4":
        return spec.expert_params() // 2 + spec.expert_params() // INT4_GROUP * 8
    return spec.expert_params() * 2


def part_decode(bandwidth_gbps: float, presets: list[str], quantization: str | None = None,
                variants: dict[str, dict] | None = None, variant_presets: list[str] | None = None) -> None:
    """variants: name -> KernelOptions fields, each a further run of every preset in variant_presets
    (default: the first), in results["decode_variants"][name][preset], right after its default run."""
    runs = []
    for preset in presets:
        runs.append((preset, "", KernelOptions()))
        if preset in (variant_presets or presets[:1]):
            runs += [(preset, name, kernel_options(fields)) for name, fields in (variants or {}).items()]
    for preset, variant, options in runs:
        gpu_engine.part_decode(bandwidth_gbps, f"dummy:{preset}", quantization, tag=f"_{preset}", kernels=options)
        run = gpu_engine.results.pop(f"decode{'_' + quantization if quantization else ''}_{preset}")
        spec = get_preset(preset)
        if spec.is_moe:  # the experts no token of the step was routed to are not read
            unread = spec.num_layers * (spec.num_experts - spec.num_experts_per_tok) * expert_bytes(spec, quantization)
            active = run["step_read_bytes"] - unread
            step_s = 1 / max(r["decode_tok_s"] for r in run["runs"])
            run |= {"step_read_bytes_active": active, "bandwidth_limit_active_tok_s": bandwidth_gbps * 1e9 / active,
                    "mbu_active": active / step_s / (bandwidth_gbps * 1e9)}
        if variant:
            results.setdefault("decode_variants", {}).setdefault(variant, {})[preset] = \
                run | {"kernel_options": variants[variant]}
        else:
            results.setdefault("decode" if quantization is None else f"decode_{quantization}", {})[preset] = run


def kernel_options(fields: dict) -> KernelOptions:
    """KernelOptions from JSON fields (decode_attention_tuning_by_batch's batch keys come as strings,
    cublas_linears' shapes as lists)."""
    if "decode_attention_tuning_by_batch" in fields:
        table = fields["decode_attention_tuning_by_batch"]
        fields = fields | {"decode_attention_tuning_by_batch": {int(batch): tuning for batch, tuning in table.items()}}
    if "cublas_linears" in fields:
        fields = fields | {"cublas_linears": tuple(map(tuple, fields["cublas_linears"]))}
    return KernelOptions(**fields)


def part_throughput(presets: list[str]) -> None:
    inputs, outputs = sharegpt_like_lengths(500)
    prompts = random_prompts(inputs)
    for preset in presets:
        llm = LLM(f"dummy:{preset}", device="cuda", max_num_seqs=512)
        results.setdefault("throughput_sharegpt_like", {})[preset] = run_offline(llm, prompts, outputs)
        del llm
        free_gpu()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="kernel,decode,throughput")
    parser.add_argument("--decode-variants", type=json.loads, default={}, metavar="JSON",
                        help='decode part: further runs of the MoE, name -> KernelOptions fields, e.g. '
                             '\'{"direct512": {"decode_attention_tuning_by_batch": {"16": {"DIRECT_KEYS": 512}}}}\'')
    parser.add_argument("--variant-presets", metavar="PRESET,...",
                        help="the presets the decode variants run on (default: the MoE alone)")
    parser.add_argument("--decode-presets", default="qwen3-30b-a3b,qwen3-8b,llama-3.1-8b", metavar="PRESET,...",
                        help="the models the decode part runs")
    args = parser.parse_args()
    results["card"] = torch.cuda.get_device_name()
    bandwidth = results["copy_bandwidth_gbps"] = copy_bandwidth_gbps()
    for part in args.parts.split(","):
        start = time.perf_counter()
        {"kernel": lambda: part_kernel(bandwidth),
         "decode": lambda: part_decode(bandwidth, args.decode_presets.split(","),
                                       variants=args.decode_variants,
                                       variant_presets=args.variant_presets and args.variant_presets.split(",")),
         "grouped-sweep": part_grouped_sweep,
         "pair-sweep": part_pair_sweep,
         "throughput": lambda: part_throughput(["qwen3-30b-a3b", "qwen3-8b"]),
         "int8": lambda: part_decode(bandwidth, ["mixtral-8x7b"], "int8"),
         "int4": lambda: part_decode(bandwidth, ["mixtral-8x7b"], "int4")}[part]()
        results.setdefault("part_seconds", {})[part] = time.perf_counter() - start
        print(part, "done", flush=True)
    print(write_result("gpu_moe.json", results))
    for name, by_preset in results.get("decode_variants", {}).items():
        for preset, run in by_preset.items():
            print(f"decode variant {name} {preset}: {max(r['decode_tok_s'] for r in run['runs']):.1f} tok/s")
    for key in ("decode", "decode_int8", "decode_int4"):
        for preset, run in results.get(key, {}).items():
            best = max(r["decode_tok_s"] for r in run["runs"])
            print(f"{key} {preset}: {best:.1f} tok/s, mbu_read {run['mbu_read']:.2f}"
                  + (f", mbu_active {run['mbu_active']:.2f}, limit {run['bandwidth_limit_active_tok_s']:.0f} tok/s"
                     if "mbu_active" in run else ""))
    for name, row in results.get("grouped_sweep", {}).items():
        print(f"grouped sweep {name}: best {row['best']} {row['best_us']:.1f} us, "
              f"grouped_tiles_for's {row['default_us']:.1f} us")
    for tokens, row in results.get("pair_sweep", {}).items():
        for name, launch in row.items():
            print(f"pair sweep {tokens} {name}: best {launch['best']} {launch['best_us']:.2f} us, "
                  f"pair_tiles_for's {launch['current_us']:.2f} us")
    for preset, run in results.get("throughput_sharegpt_like", {}).items():
        print(f"sharegpt-like 500 requests {preset}: {run['output_tok_s']:.0f} output tok/s")


if __name__ == "__main__":
    main()
