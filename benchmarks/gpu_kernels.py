"""GPU check and timing of goodserve's Triton kernels against the plain-torch references.

For each kernel: relative error against the torch reference in bf16 on fresh random inputs, and the
median time against the bytes-moved floor at the device-to-device copy bandwidth measured in the
same run. Shapes are a Llama-3.1-8B layer (32 q heads, 8 kv heads, head_dim 128, hidden 4096,
intermediate 14336, vocab 128256), KV block size 16.

Two clocks: `ms` is triton.testing.do_bench (each call launched from Python, so microsecond kernels
include launch gaps); `graph_us` replays a CUDA graph of 20 back-to-back launches, the time a
kernel costs inside the engine's decode graph. Batch-1 decode rows use the graphs' layout: a block
table sized for max_model_len 8192, column-major.

    python benchmarks/gpu_kernels.py            # writes $OUT/gpu_kernels.json (OUT defaults to ./out)
    python benchmarks/gpu_kernels.py --quick    # fewer shapes, no tuning sweeps
    python benchmarks/gpu_kernels.py --decode-sweep 8x1000,256x300  # only: decode splits and tiles
    python benchmarks/gpu_kernels.py --decode-latency-sweep  # only: batch 1-16 decode launches, fused RoPE (~1.5 min)
    python benchmarks/gpu_kernels.py --decode-latency-sweep --kv-heads 4  # the same for Qwen3-30B-A3B's 4 KV heads
    python benchmarks/gpu_kernels.py --smoke    # CPU, TRITON_INTERPRET=1, tiny shapes: catches Python errors
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, so before importing them
elif not torch.cuda.is_available():
    sys.exit("benchmarks/gpu_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); try --smoke")

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from goodserve.ops.activation import silu_and_mul_torch  # noqa: E402
from goodserve.ops.attention import (  # noqa: E402
    AttentionMetadata, LayerKVCache, decode_attention_torch, paged_attention_reference, rotary_write_kv_torch,
)
from goodserve.ops.norm import add_rms_norm_torch  # noqa: E402
from goodserve.ops import triton_attention, triton_ops  # noqa: E402
from goodserve.ops.pdl import device_supports_pdl  # noqa: E402
from goodserve.ops.rotary import cos_sin_cache  # noqa: E402
from goodserve.ops.triton_attention import DECODE_TUNING, default_num_splits  # noqa: E402

DEVICE = torch.device("cpu" if SMOKE else "cuda")
# The kernels launch as the engine launches them on this GPU: with PDL where it has it (ops/pdl.py).
PDL = not SMOKE and device_supports_pdl(torch.cuda.current_device())
triton_decode_attention, triton_prefill_attention, triton_rotary_write_kv, triton_add_rms_norm, triton_argmax, \
    triton_silu_and_mul = (functools.partial(kernel, pdl=PDL) for kernel in (
        triton_attention.triton_decode_attention, triton_attention.triton_prefill_attention,
        triton_attention.triton_rotary_write_kv, triton_ops.triton_add_rms_norm, triton_ops.triton_argmax,
        triton_ops.triton_silu_and_mul))
if SMOKE:
    HQ, HK, D, HIDDEN, INTER, VOCAB, BLOCK, GRAPH_MAX_LEN = 4, 2, 32, 64, 96, 5000, 16, 256
else:
    HQ, HK, D, HIDDEN, INTER, VOCAB, BLOCK, GRAPH_MAX_LEN = 32, 8, 128, 4096, 14336, 128256, 16, 8192
BF16 = torch.bfloat16
rows: list[dict] = []


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12)).item()


def bench_ms(fn) -> float:
    if SMOKE:
        fn()
        return 0.0
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_us(fn, launches: int = 20, rep: int = 100) -> float | None:
    """Microseconds per call of fn replayed inside a CUDA graph (no host launch cost between calls);
    rep: milliseconds of replays to take the median over."""
    if SMOKE:
        fn()
        return None
    fn()  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    ms = do_bench(graph.replay, warmup=10, rep=rep, return_mode="median")
    return ms * 1e3 / launches


def cold_graph_us(calls: list) -> float | None:
    """Microseconds per call of a CUDA graph launching each of `calls` once in turn: calls over copies
    of the same inputs whose bytes together exceed L2, so each launch reads its K/V from HBM, as a
    decode step's layers do (graph_us replays one launch on the same K/V, which L2 then holds)."""
    if SMOKE:
        calls[0]()
        return None
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    ms = do_bench(graph.replay, warmup=3, rep=100, return_mode="median")
    return ms * 1e3 / len(calls)


def copies_past_l2(cache: LayerKVCache) -> list[LayerKVCache]:
    """The cache and copies of it, twice the GPU's L2 in all (one on the CPU)."""
    if SMOKE:
        return [cache]
    pools = [t for t in (cache.k, cache.v, cache.k_scale, cache.v_scale) if t is not None]
    count = triton.cdiv(2 * torch.cuda.get_device_properties(DEVICE).L2_cache_size, sum(t.nbytes for t in pools))
    clone = lambda t: None if t is None else t.clone()  # noqa: E731
    return [cache] + [dataclasses.replace(cache, k=clone(cache.k), v=clone(cache.v), k_scale=clone(cache.k_scale),
                                          v_scale=clone(cache.v_scale)) for _ in range(count - 1)]


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted)."""
    if SMOKE:
        return 1e12
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def record(kernel: str, shape: str, ms: float, nbytes: float, bw: float, err: float | None = None,
           torch_ms: float | None = None, flops: float | None = None, **extra) -> None:
    row = {"kernel": kernel, "shape": shape, "ms": ms, "bytes": nbytes, "floor_ms": nbytes / bw * 1e3,
           "bw_fraction": nbytes / bw / (ms * 1e-3) if ms else None, "rel_err": err, "torch_ms": torch_ms, **extra}
    if flops is not None and ms:
        row["tflops"] = flops / (ms * 1e-3) / 1e12
    rows.append(row)
    graph = extra.get("graph_us")
    checks = "".join(f"  {k} {v:.3g}" if isinstance(v, float) else f"  {k} {v}"
                     for k, v in extra.items() if k not in ("graph_us", "tuning") and v is not None)
    print(f"  {kernel:16s} {shape:40s} {ms:8.4f} ms" + (f"  {row['bw_fraction']:6.1%} of copy bw" if ms else "")
          + (f"  graph {graph:6.2f} us" if graph is not None else "")
          + (f"  err {err:.2e}" if err is not None else "") + (f"  torch {torch_ms:.4f} ms" if torch_ms else "")
          + checks, flush=True)


# ---------------------------------------------------------------------------------------------
# Paged batches


def make_paged(batch: int, q_lens: list[int], seq_lens: list[int], kv_dtype: torch.dtype, seed: int,
               capacity: int | None = None, column_major: bool = False, heads: tuple[int, int, int] | None = None):
    """Random K/V for every sequence's whole context, in shuffled blocks; q for the new tokens.

    capacity: tokens the block table has room for (default: the longest sequence); column_major:
    the decode graphs' table layout; heads: (q heads, KV heads, head dim), default the 8B layer's.
    """
    HQ, HK, D = heads or (globals()["HQ"], globals()["HK"], globals()["D"])  # noqa: N806
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    blocks = [triton.cdiv(s, BLOCK) for s in seq_lens]
    num_blocks = sum(blocks) + 1
    shape = (num_blocks, BLOCK, HK, D)
    if kv_dtype == torch.int8:
        k = torch.randint(-127, 128, shape, dtype=torch.int8, device=DEVICE, generator=gen)
        v = torch.randint(-127, 128, shape, dtype=torch.int8, device=DEVICE, generator=gen)
        scales = [torch.rand(shape[:3], device=DEVICE, generator=gen) / 64 for _ in range(2)]
        cache = LayerKVCache(k, v, *scales)
    else:
        cache = LayerKVCache(torch.randn(shape, device=DEVICE, generator=gen).to(kv_dtype),
                             torch.randn(shape, device=DEVICE, generator=gen).to(kv_dtype))
    perm = torch.randperm(num_blocks, device=DEVICE, generator=gen).to(torch.int32)
    width = triton.cdiv(capacity, BLOCK) if capacity else max(blocks)
    table = torch.zeros(width, batch, dtype=torch.int32, device=DEVICE).t() if column_major else \
        torch.zeros(batch, width, dtype=torch.int32, device=DEVICE)
    start = 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[start : start + n]
        start += n
    q = torch.randn(sum(q_lens), HQ, D, device=DEVICE, generator=gen).to(BF16)
    meta = AttentionMetadata(
        slot_mapping=torch.full((sum(q_lens),), -1, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=table, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_lens_host=q_lens, seq_lens_host=seq_lens,
    )
    return q, cache, meta


def kv_bytes(cache: LayerKVCache, tokens: int) -> int:
    per_token = 2 * HK * D * cache.k.element_size() + (2 * HK * 4 if cache.k_scale is not None else 0)
    return tokens * per_token


def decode_reference(q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata) -> torch.Tensor:
    """The torch decode path, 8 sequences at a time: whole-batch GQA expansion would not fit."""
    outs = []
    for i in range(0, q.shape[0], 8):
        lens = meta.seq_lens_host[i : i + 8]
        width = triton.cdiv(max(lens), BLOCK)
        part = AttentionMetadata(meta.slot_mapping[i : i + 8], meta.query_start_loc[: len(lens) + 1],
                                 meta.seq_lens[i : i + 8], meta.block_tables[i : i + 8, :width], 1, max(lens),
                                 [1] * len(lens), lens)
        outs.append(decode_attention_torch(q[i : i + 8], cache, part, D**-0.5))
    return torch.cat(outs)


def decode_call(q, cache, meta, tuning=None):
    return lambda: triton_decode_attention(q, cache, meta.block_tables, meta.seq_lens, D**-0.5, tuning=tuning)


def bench_decode(bw: float, batches: list[int], contexts: list[int]) -> None:
    print("decode attention (one query per sequence)")
    for batch in batches:
        for ctx in contexts:
            if batch * ctx > 64 * 32768:
                continue
            q, cache, meta = make_paged(batch, [1] * batch, [ctx] * batch, BF16, seed=batch + ctx)
            call = decode_call(q, cache, meta)
            err = rel_err(call(), decode_reference(q, cache, meta))
            torch_ms = bench_ms(lambda: decode_attention_torch(q, cache, meta, D**-0.5)) \
                if batch * ctx <= 8 * 8192 else None
            splits = default_num_splits(batch, HK, meta.block_tables.shape[1] * BLOCK, DEVICE,
                                        DECODE_TUNING["SPLIT_KEYS"])
            record("decode", f"B={batch} ctx={ctx} splits={splits}", bench_ms(call), kv_bytes(cache, batch * ctx), bw,
                   err, torch_ms, graph_us=graph_us(call))
            del q, cache, meta
            torch.cuda.empty_cache()


def bench_decode_graph_layout(bw: float, sweep: bool) -> None:
    """Decode as the engine's graphs run it: table sized for GRAPH_MAX_LEN, column-major, short
    contexts. With `sweep`, the split and tile sizes too (DECODE_TUNING holds the default)."""
    print(f"decode attention, graph layout (table for {GRAPH_MAX_LEN} tokens, column-major)")
    cases = [(1, 128), (1, 384), (1, 1024), (1, 4096), (8, 512), (64, 2048)]
    if SMOKE:
        cases = [(1, 16), (1, 40), (2, 100)]
    tunings = [{}]
    if sweep:
        tunings += [{"BLOCK_N": n, "SPLIT_KEYS": k, "num_warps": w} for n in (32, 64) for k in (16, 32, 64, 128)
                    for w in (4, 8) if (n, k, w) != (DECODE_TUNING["BLOCK_N"], DECODE_TUNING["SPLIT_KEYS"], 4)]
    for batch, ctx in cases:
        q, cache, meta = make_paged(batch, [1] * batch, [ctx] * batch, BF16, seed=ctx, capacity=GRAPH_MAX_LEN,
                                    column_major=True)
        ref = decode_reference(q, cache, meta)
        for tuning in tunings:
            call = decode_call(q, cache, meta, tuning)
            splits = default_num_splits(batch, HK, GRAPH_MAX_LEN, DEVICE, {**DECODE_TUNING, **tuning}["SPLIT_KEYS"])
            label = " ".join(f"{k}={v}" for k, v in tuning.items()) or "default"
            record("decode-graph" if not tuning else "decode-graph-tune", f"B={batch} ctx={ctx} s{splits} {label}",
                   bench_ms(call), kv_bytes(cache, batch * ctx), bw, rel_err(call(), ref), graph_us=graph_us(call),
                   tuning=tuning)
        if batch > 1:  # the same batch with a row-major table: what the column-major layout costs
            row_major = make_paged(batch, [1] * batch, [ctx] * batch, BF16, seed=ctx, capacity=GRAPH_MAX_LEN)
            call = decode_call(*row_major)
            record("decode-graph", f"B={batch} ctx={ctx} row-major table", bench_ms(call),
                   kv_bytes(cache, batch * ctx), bw, rel_err(call(), ref), graph_us=graph_us(call))


def bench_decode_cache_dtypes(bw: float) -> None:
    print("decode attention, quantized caches")
    batch, ctx = (8, 8192) if not SMOKE else (2, 64)
    for kv_dtype in (torch.int8, torch.float8_e4m3fn):
        q, cache, meta = make_paged(batch, [1] * batch, [ctx] * batch, kv_dtype, seed=7)
        if SMOKE:  # the interpreter converts int8 to bf16 wrongly (NaNs); a float32 q avoids that cast
            q = q.float()
        call = decode_call(q, cache, meta)
        record("decode", f"B={batch} ctx={ctx} kv={str(kv_dtype)[6:]}", bench_ms(call), kv_bytes(cache, batch * ctx),
               bw, rel_err(call(), decode_reference(q, cache, meta)))


def sweep_decode_tuning(bw: float) -> None:
    """Which launch settings come closest to the bandwidth floor at long contexts."""
    print("decode tuning sweep")
    for batch, ctx in ((1, 32768), (64, 2048)):
        q, cache, meta = make_paged(batch, [1] * batch, [ctx] * batch, BF16, seed=3)
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    tuning = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
                    try:
                        ms = bench_ms(decode_call(q, cache, meta, tuning))
                    except Exception as e:  # e.g. out of shared memory: report, keep sweeping
                        print(f"  {tuning}: {type(e).__name__}")
                        continue
                    record("decode-tune", f"B={batch} ctx={ctx} n{block_n} w{warps} s{stages}", ms,
                           kv_bytes(cache, batch * ctx), bw, tuning=tuning)


def sweep_decode_batches(bw: float, cases: list[tuple[int, int]]) -> None:
    """Splits and tiles for decode at the (batch, context) cases of a ShareGPT-like run (graph layout):
    over that whole run, decode attention is the kernel with the most device time."""
    print("decode sweep over batches (graph layout)")
    tiles = [(n, w, st) for n in (32, 64, 128) for w in (2, 4, 8) for st in (2, 3, 4)]
    if SMOKE:
        cases, tiles = [(2, 40)], tiles[:2]
    for batch, ctx in cases:
        q, cache, meta = make_paged(batch, [1] * batch, [ctx] * batch, BF16, seed=ctx + batch,
                                    capacity=GRAPH_MAX_LEN, column_major=True)
        ref = decode_reference(q, cache, meta)
        for block_n, warps, stages in tiles:
            for splits in (1, 2, 4, 8, 16, 32):
                if splits > 1 and batch * HK * splits > 8 * 132:  # more than ~8 programs a SM: never better
                    continue
                for split_keys in ((64,) if splits == 1 else (64, 128)):
                    tuning = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages, "SPLIT_KEYS": split_keys}
                    args = (q, cache, meta.block_tables, meta.seq_lens, D**-0.5)
                    call = lambda: triton_decode_attention(*args, num_splits=splits, tuning=tuning)  # noqa: E731
                    try:
                        err = rel_err(call(), ref)
                        record("decode-sweep", f"B={batch} ctx={ctx} s{splits} k{split_keys} n{block_n} w{warps} "
                               f"st{stages}", 0.0, kv_bytes(cache, batch * ctx), bw, err, graph_us=graph_us(call),
                               tuning={**tuning, "splits": splits})
                    except Exception as e:  # e.g. out of shared memory: report, keep sweeping
                        print(f"  {tuning} splits={splits}: {type(e).__name__}")


# Launch settings against DECODE_TUNING (the first, {}): one split up to DIRECT_KEYS keys (a plain
# kernel argument: the three values share each tile shape's compiled kernel), wider tiles.
LATENCY_VARIANTS = [{}] + [
    {"DIRECT_KEYS": keys, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
    for block_n, warps, stages in ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 2), (256, 8, 1))
    for keys in (256, 512, 1024)
] + [
    {"SPLIT_KEYS": 128},
    {"SPLIT_KEYS": 32, "BLOCK_N": 32},
    {"DIRECT_KEYS": 128, "SPLIT_KEYS": 32, "BLOCK_N": 32},
    {"DIRECT_KEYS": 256, "SPLIT_KEYS": 128, "BLOCK_N": 128, "num_warps": 4},
]


def decode_step_inputs(batch: int, ctx: int):
    """A graph-layout decode batch plus what RoPE + the cache write take: k, v views into one qkv
    projection, positions ctx - 1 and each sequence's slot for that position."""
    q, cache, meta = make_paged(batch, [1] * batch, [ctx] * batch, BF16, seed=ctx + batch, capacity=GRAPH_MAX_LEN,
                                column_major=True)
    qkv = torch.randn(batch, (HQ + 2 * HK) * D, device=DEVICE).to(BF16)
    q_view, k, v = (x.view(batch, -1, D) for x in qkv.split([HQ * D, HK * D, HK * D], dim=-1))
    q_view.copy_(q)
    positions = torch.full((batch,), ctx - 1, device=DEVICE)
    slots = (meta.block_tables[:, (ctx - 1) // BLOCK].long() * BLOCK + (ctx - 1) % BLOCK).to(torch.int32)
    table = cos_sin_cache(D, GRAPH_MAX_LEN, 500000.0, None).to(DEVICE)
    return q_view, cache, meta, triton_attention.NewTokens(k, v, positions, table, slots)


def sweep_decode_latency(bw: float, batches: list[int], contexts: list[int]) -> dict[int, dict]:
    """Decode attention where it is latency, not bytes (batch 1, short contexts): each of
    LATENCY_VARIANTS at every batch x context, CUDA-graph timed with its K/V in HBM (cold_graph_us: a
    step's layers find theirs there) and, for reference, in L2, then per batch RoPE + cache write as
    its own kernel (as now) against fused into decode attention (KernelOptions.fuse_rotary_into_decode_attention).
    Returns the table for KernelOptions.decode_attention_tuning_by_batch: per batch (the largest it
    stands for), the variant with the smallest mean cold time relative to each context's best (each
    context counts alike)."""
    print("decode latency sweep (graph layout)")
    variants = LATENCY_VARIANTS[:3] if SMOKE else LATENCY_VARIANTS
    times: dict[tuple[int, int], list[float]] = {}
    for batch in batches:
        for ctx in contexts:
            q, cache, meta = make_paged(batch, [1] * batch, [ctx] * batch, BF16, seed=ctx + batch,
                                        capacity=GRAPH_MAX_LEN, column_major=True)
            ref = decode_reference(q, cache, meta)
            caches = copies_past_l2(cache)
            for i, tuning in enumerate(variants):
                call = decode_call(q, cache, meta, tuning)
                try:
                    err = rel_err(call(), ref)
                    us = cold_graph_us([decode_call(q, copy, meta, tuning) for copy in caches])
                    hot_us = graph_us(call, rep=40)
                except Exception as e:  # e.g. out of shared memory: report, keep sweeping
                    print(f"  {tuning}: {type(e).__name__}")
                    us = hot_us = float("inf")
                    err = None
                times.setdefault((batch, ctx), []).append(us if us is not None else 0.0)
                record("decode-latency", f"B={batch} ctx={ctx} v{i} {tuning or 'current'}", 0.0,
                       kv_bytes(cache, batch * ctx), bw, err, graph_us=us, l2_graph_us=hot_us, tuning=tuning)
            del caches
    table = {}
    for batch in batches:
        def mean_slowdown(i: int) -> float:
            return sum(times[batch, ctx][i] / max(min(times[batch, ctx]), 1e-9) for ctx in contexts) / len(contexts)
        best = min(range(len(variants)), key=mean_slowdown)
        for ctx in contexts:
            row = times[batch, ctx]
            winner = min(range(len(variants)), key=row.__getitem__)
            print(f"  B={batch} ctx={ctx}: current {row[0]:.2f} us, winner v{winner} {row[winner]:.2f} us "
                  f"{variants[winner]}, batch's pick v{best} {row[best]:.2f} us")
        print(f"  B={batch}: pick v{best} {variants[best] or 'current'} (mean {mean_slowdown(best):.3f}x each "
              f"context's best; current {mean_slowdown(0):.3f}x)")
        table[batch] = variants[best]  # {} too: a batch the default suits must not fall to a larger one's entry
        bench_fused_rotary(batch, contexts, [{}, variants[best]] if best else [{}])
    return table


def bench_fused_rotary(batch: int, contexts: list[int], tunings: list[dict]) -> None:
    """RoPE + cache write then decode attention (two launches) against the fused launch, both exact:
    the fused output and cache must equal the two kernels' bit for bit."""
    for ctx in contexts:
        for tuning in tunings:
            q, cache, meta, new = decode_step_inputs(batch, ctx)
            args = (cache, meta.block_tables, meta.seq_lens, D**-0.5)
            fused_cache = LayerKVCache(cache.k.clone(), cache.v.clone())
            fused_out = triton_decode_attention(q, fused_cache, *args[1:], tuning=tuning, new_tokens=new)
            rotated = q.clone()
            triton_rotary_write_kv(rotated, new.k, new.v, new.positions, new.rotary_cache, cache, new.slot_mapping)
            two_out = triton_decode_attention(rotated, *args, tuning=tuning)
            identical = torch.equal(fused_out, two_out) and torch.equal(fused_cache.k, cache.k) \
                and torch.equal(fused_cache.v, cache.v)

            def two_kernels():
                triton_rotary_write_kv(q, new.k, new.v, new.positions, new.rotary_cache, cache, new.slot_mapping)
                triton_decode_attention(q, *args, tuning=tuning)

            fused = lambda: triton_decode_attention(q, *args, tuning=tuning, new_tokens=new)  # noqa: E731
            label = f"B={batch} ctx={ctx} {tuning or 'current'}"
            two_us, fused_us = graph_us(two_kernels, rep=40), graph_us(fused, rep=40)
            rows.append({"kernel": "decode-fused-rotary", "shape": label, "two_kernels_graph_us": two_us,
                         "fused_graph_us": fused_us, "identical": identical, "tuning": tuning})
            print(f"  RoPE + write + decode {label}: two kernels "
                  + (f"{two_us:.2f} us, fused {fused_us:.2f} us" if two_us else "(not timed)")
                  + f", identical {identical}", flush=True)


def check_decode_cuda_graph() -> None:
    """Capture decode once at a graph-sized table, then replay with new lengths (short, empty,
    split-boundary, long): every result must match the reference, and repeated replays must agree
    bit for bit (the last split to arrive merges, in a fixed order; a race would show here)."""
    print("decode attention under a CUDA graph")
    for batch, lens_after in ((1, [[1], [63], [64], [65], [300], [4096], [8000]]),
                              (4, [[4096, 3000, 17, 2500], [0, 1, 130, 8000], [64, 65, 128, 129]])):
        q, cache, meta = make_paged(batch, [1] * batch, [8000] * batch, BF16, seed=11, capacity=8192,
                                    column_major=True)
        args = (q, cache, meta.block_tables, meta.seq_lens, D**-0.5)
        triton_decode_attention(*args)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = triton_decode_attention(*args)
        worst_err, mismatched_replays = 0.0, 0
        for lens in lens_after:
            meta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
            graph.replay()
            first = out.clone()
            for _ in range(50):
                graph.replay()
                mismatched_replays += int(not torch.equal(out, first))
            live = [i for i, n in enumerate(lens) if n > 0]
            sub = AttentionMetadata(meta.slot_mapping[live], meta.query_start_loc, meta.seq_lens[live],
                                    meta.block_tables[live], 1, max(lens), [1] * len(live), [lens[i] for i in live])
            worst_err = max(worst_err, rel_err(first[live], paged_attention_reference(q[live], cache, sub, D**-0.5)))
            assert all(first[i].abs().max() == 0 for i in range(batch) if lens[i] == 0), "padding rows must be 0"
        rows.append({"kernel": "decode-cuda-graph", "shape": f"B={batch} lens changed after capture",
                     "rel_err": worst_err, "mismatched_replays": mismatched_replays})
        print(f"  B={batch}: worst rel err {worst_err:.2e}, replays differing from the first: {mismatched_replays}")


def bench_prefill(bw: float) -> None:
    print("prefill attention (varlen, causal, paged)")
    cases = [("2K prompt", [2048], [2048]), ("4 x 512 prompts", [512] * 4, [512] * 4),
             ("512 chunk on 8K ctx", [512], [8192]), ("mixed 1K prefill + 32 decodes", [1024] + [1] * 32,
                                                      [1024] + [2048] * 32)]
    if SMOKE:
        cases = [("small", [20, 1], [20, 40])]
    for name, q_lens, seq_lens in cases:
        q, cache, meta = make_paged(len(q_lens), q_lens, seq_lens, BF16, seed=len(q_lens))
        args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, D**-0.5)
        out = triton_prefill_attention(*args)
        ref = paged_attention_reference(q, cache, meta, D**-0.5)
        ms = bench_ms(lambda: triton_prefill_attention(*args))
        visible = sum(ql * (sl - ql) + ql * (ql + 1) // 2 for ql, sl in zip(q_lens, seq_lens))
        flops = 4 * HQ * D * visible
        torch_ms = None
        if len(q_lens) == 1 and q_lens[0] == seq_lens[0]:  # contiguous flash SDPA as the yardstick
            qt = q.transpose(0, 1).unsqueeze(0)
            kt = torch.randn(1, HK, seq_lens[0], D, device=DEVICE, dtype=BF16)
            torch_ms = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                qt, kt, kt, is_causal=True, enable_gqa=True))
        record("prefill", name, ms, kv_bytes(cache, sum(seq_lens)) + 2 * q.numel() * 2, bw, rel_err(out, ref),
               torch_ms, flops=flops)


# Prefill tile sweep: verify steps (1 + 4 tokens a sequence on a 512-token context) and prompts, in
# float32 (exact dots, no tensor cores) and bf16, on the 8B's and the embedded model's head shapes.
PREFILL_SWEEP_CASES = [("verify b1", [5], [512]), ("verify b8", [5] * 8, [512] * 8),
                       ("verify b32", [5] * 32, [512] * 32), ("512 prompt", [512], [512]),
                       ("2K prompt", [2048], [2048])]
PREFILL_SWEEP_TUNINGS = [
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 2, "num_stages": 2},
    {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
]
PREFILL_SWEEP_HEADS = {"8B": (32, 8, 128), "135M": (9, 3, 64)}


def sweep_prefill_tuning(bw: float) -> dict:
    """Median ms of each tuning per (dtype, heads, case), its error against the reference, and the
    fastest per case."""
    cases = [("verify b2", [5] * 2, [40] * 2), ("prompt", [40], [40])] if SMOKE else PREFILL_SWEEP_CASES
    tunings = PREFILL_SWEEP_TUNINGS[-2:] if SMOKE else PREFILL_SWEEP_TUNINGS
    best = {}
    for dtype in (torch.float32, BF16):
        for shape_name, heads in PREFILL_SWEEP_HEADS.items():
            for name, q_lens, seq_lens in cases:
                q, cache, meta = make_paged(len(q_lens), q_lens, seq_lens, dtype, seed=len(q_lens), heads=heads)
                q = q.to(dtype)
                args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, heads[2] ** -0.5)
                ref = paged_attention_reference(q, cache, meta, heads[2] ** -0.5)
                times = {}
                for tune in tunings:
                    out = triton_prefill_attention(*args, tuning=tune)
                    ms = 0.0 if SMOKE else bench_ms(lambda: triton_prefill_attention(*args, tuning=tune))
                    label = f"{tune['BLOCK_M']}x{tune['BLOCK_N']}w{tune['num_warps']}s{tune['num_stages']}"
                    times[label] = ms
                    record("prefill-sweep", f"{str(dtype)[6:]} {shape_name} {name} {label}", ms,
                           2 * cache.k.numel() * cache.k.element_size(), bw, rel_err(out, ref), tuning=tune)
                best[f"{str(dtype)[6:]} {shape_name} {name}"] = {"fastest": min(times, key=times.get), "ms": times}
    print(json.dumps(best, indent=1))
    return best


# ---------------------------------------------------------------------------------------------
# RoPE + cache write, the small fused ops, argmax


def bench_rotary_write_kv(bw: float) -> None:
    """The fused kernel (q rotated in place, rotated k and v into the cache) against the torch
    reference: mismatched fractions of q and of the cache bytes (0 expected but for rare float
    rounding differences), and its time; before it, a rotary and a write_kv kernel ran separately
    (2.05 + 1.46 us per layer at batch 1 in results/gpu_profile_b1_h200.txt)."""
    print("RoPE + KV-cache write")
    table = cos_sin_cache(D, GRAPH_MAX_LEN, 500000.0, None).to(DEVICE)
    for tokens in ((1, 64, 2048) if not SMOKE else (1, 5)):
        for kv_dtype in (BF16, torch.int8, torch.float8_e4m3fn):
            qkv = torch.randn(tokens, (HQ + 2 * HK) * D, device=DEVICE).to(BF16)
            q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
            q, k, v = q.view(tokens, HQ, D), k.view(tokens, HK, D), v.view(tokens, HK, D)
            num_blocks = triton.cdiv(tokens, BLOCK) + 8
            slots = torch.randperm(num_blocks * BLOCK, device=DEVICE)[:tokens].to(torch.int32)
            slots[1::7] = -1
            positions = torch.randint(0, GRAPH_MAX_LEN, (tokens,), device=DEVICE)

            def fresh() -> LayerKVCache:
                shape = (num_blocks, BLOCK, HK, D)
                pools = [torch.zeros(shape, dtype=kv_dtype, device=DEVICE) for _ in range(2)]
                scales = [torch.zeros(shape[:3], device=DEVICE) for _ in range(2)] if kv_dtype == torch.int8 else []
                return LayerKVCache(*pools, *scales)

            ours, ref = fresh(), fresh()
            ours_q, ref_q = q.clone(), q.clone()
            triton_rotary_write_kv(ours_q, k, v, positions, table, ours, slots)
            rotary_write_kv_torch(ref_q, k, v, positions, table, ref, slots)
            cache_mismatch = (ours.k.view(torch.uint8) != ref.k.view(torch.uint8)).float().mean().item()
            q_mismatch = (ours_q != ref_q).float().mean().item()
            call = lambda: triton_rotary_write_kv(q, k, v, positions, table, ours, slots)  # noqa: E731
            nbytes = 2 * q.numel() * 2 + 2 * k.numel() * 2 + kv_bytes(ours, tokens)
            record("rotary_write_kv", f"T={tokens} kv={str(kv_dtype)[6:]}", bench_ms(call), nbytes, bw, None,
                   bench_ms(lambda: rotary_write_kv_torch(q, k, v, positions, table, ref, slots)),
                   graph_us=graph_us(call), q_mismatch_fraction=q_mismatch, cache_mismatch_fraction=cache_mismatch)


def bench_argmax(bw: float) -> None:
    print("argmax over the vocabulary (greedy sampling)")
    for batch in (1, 8, 64):
        logits = torch.randn(batch, VOCAB, device=DEVICE)
        logits[:, VOCAB // 3] = logits[:, VOCAB // 2] = 10.0  # a tie: the first index must win
        exact = torch.equal(triton_argmax(logits), logits.argmax(dim=-1))
        call = lambda: triton_argmax(logits)  # noqa: E731
        record("argmax", f"B={batch} V={VOCAB}", bench_ms(call), logits.numel() * 4, bw, None,
               bench_ms(lambda: logits.argmax(dim=-1)), graph_us=graph_us(call),
               torch_graph_us=graph_us(lambda: logits.argmax(dim=-1)), identical_to_torch=exact)


def bench_small_ops(bw: float) -> None:
    print("fused small ops")
    for tokens in ((1, 64, 2048) if not SMOKE else (3,)):
        x, residual = torch.randn(2, tokens, HIDDEN, device=DEVICE).to(BF16)
        weight = (1 + 0.1 * torch.randn(HIDDEN, device=DEVICE)).to(BF16)
        normed, new_res = triton_add_rms_norm(x, residual, weight, 1e-5)
        ref_normed, ref_res = add_rms_norm_torch(x, residual, weight, 1e-5)
        err = max(rel_err(normed, ref_normed), rel_err(new_res, ref_res))
        call = lambda: triton_add_rms_norm(x, residual, weight, 1e-5)  # noqa: E731
        record("add_rms_norm", f"T={tokens} H={HIDDEN}", bench_ms(call), 5 * x.numel() * 2, bw, err,
               bench_ms(lambda: add_rms_norm_torch(x, residual, weight, 1e-5)), graph_us=graph_us(call))

        gate_up = torch.randn(tokens, 2 * INTER, device=DEVICE).to(BF16)
        err = rel_err(triton_silu_and_mul(gate_up), silu_and_mul_torch(gate_up))
        call = lambda: triton_silu_and_mul(gate_up)  # noqa: E731
        record("silu_and_mul", f"T={tokens} I={INTER}", bench_ms(call), gate_up.numel() * 2 * 3 // 2, bw, err,
               bench_ms(lambda: silu_and_mul_torch(gate_up)), graph_us=graph_us(call))


# ---------------------------------------------------------------------------------------------


def print_table() -> None:
    print(f"\n{'kernel':18s} {'shape':44s} {'ms':>9s} {'graph us':>9s} {'floor ms':>9s} {'bw%':>6s} "
          f"{'TFLOP/s':>8s} {'torch ms':>9s} {'rel err':>9s}")
    for r in rows:
        if r["kernel"] in ("decode-tune", "decode-graph-tune", "decode-fused-rotary"):
            continue
        fmt = lambda key, spec: format(r[key], spec) if r.get(key) is not None else "-"  # noqa: E731
        bw_pct = format(100 * r["bw_fraction"], "5.1f") if r.get("bw_fraction") else "-"
        print(f"{r['kernel']:18s} {r['shape']:44s} {fmt('ms', '9.4f'):>9s} {fmt('graph_us', '9.2f'):>9s} "
              f"{fmt('floor_ms', '9.4f'):>9s} {bw_pct:>6s} {fmt('tflops', '8.1f'):>8s} {fmt('torch_ms', '9.4f'):>9s} "
              f"{fmt('rel_err', '9.2e'):>9s}")
    tuned = [r for r in rows if r["kernel"] == "decode-tune"]
    for shape in sorted({r["shape"].rsplit(" n", 1)[0] for r in tuned}):
        best = min((r for r in tuned if r["shape"].startswith(shape + " n")), key=lambda r: r["ms"])
        print(f"best decode tuning for {shape}: {best['tuning']} {best['ms']:.4f} ms ({best['bw_fraction']:.1%} of copy bw)")
    graph_rows = [r for r in rows if r["kernel"].startswith("decode-graph") and r.get("graph_us")]
    for shape in sorted({r["shape"].split(" s")[0] for r in graph_rows if "row-major" not in r["shape"]}):
        best = min((r for r in graph_rows if r["shape"].startswith(shape + " s")), key=lambda r: r["graph_us"])
        print(f"best graph-layout decode for {shape}: {best['tuning'] or 'default'} {best['graph_us']:.2f} us")

    swept = [r for r in rows if r["kernel"] == "decode-sweep" and r.get("graph_us")]
    for shape in sorted({r["shape"].split(" s")[0] for r in swept}):
        best = min((r for r in swept if r["shape"].startswith(shape + " s")), key=lambda r: r["graph_us"])
        floor_us = best["floor_ms"] * 1e3
        print(f"best decode for {shape}: {best['tuning']} {best['graph_us']:.2f} us (floor {floor_us:.2f} us)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes, no tuning sweeps")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes, no timing")
    parser.add_argument("--decode-sweep", metavar="BxCTX,...", help="only the decode sweep, at these batches x contexts")
    parser.add_argument("--decode-latency-sweep", action="store_true",
                        help="only: decode launch variants at batch 1/4/16, contexts 128-4096, and fused RoPE; "
                             "writes $OUT/decode_tuning_by_batch.json")
    parser.add_argument("--kv-heads", type=int, metavar="N",
                        help="KV heads of the layer (default 8, Llama-3.1-8B's; 4: Qwen3-30B-A3B's, 32 q heads both)")
    parser.add_argument("--prefill-sweep", action="store_true",
                        help="only: prefill tiles for verify steps and prompts, float32 and bf16 (~1 min)")
    args = parser.parse_args()
    if args.kv_heads:
        globals()["HK"] = args.kv_heads
    torch.manual_seed(0)
    started = time.time()
    bw = copy_bandwidth()
    device_name = "cpu (TRITON_INTERPRET=1)" if SMOKE else torch.cuda.get_device_name()
    print(f"{device_name}: device-to-device copy {bw / 1e12:.2f} TB/s")
    table = None
    if args.prefill_sweep:
        table = sweep_prefill_tuning(bw)
    elif args.decode_latency_sweep:
        table = sweep_decode_latency(bw, [2] if SMOKE else [1, 4, 16], [16, 40] if SMOKE else [128, 256, 1024, 4096])
    elif args.decode_sweep:
        sweep_decode_batches(bw, [tuple(map(int, case.split("x"))) for case in args.decode_sweep.split(",")])
    elif SMOKE:
        bench_decode(bw, [1, 2], [16, 40])
    else:
        bench_decode(bw, [1, 8, 64], [512, 4096, 32768] if args.quick else [512, 2048, 8192, 32768])
    only = args.decode_sweep or args.decode_latency_sweep or args.prefill_sweep
    if not only:
        bench_decode_graph_layout(bw, sweep=not (args.quick or SMOKE))
        bench_decode_cache_dtypes(bw)
        if not SMOKE:
            check_decode_cuda_graph()
        bench_prefill(bw)
        bench_rotary_write_kv(bw)
        bench_argmax(bw)
        bench_small_ops(bw)
    if not (args.quick or SMOKE or only):
        sweep_decode_tuning(bw)
    out_dir = os.environ.get("OUT", "./out")
    os.makedirs(out_dir, exist_ok=True)
    if table is not None and args.decode_latency_sweep:
        with open(os.path.join(out_dir, "decode_tuning_by_batch.json"), "w") as f:
            json.dump(table, f, indent=1)
        print(f"KernelOptions(decode_attention_tuning_by_batch={table!r})  (also in decode_tuning_by_batch.json)")
    result = {
        "device": device_name, "torch": torch.__version__, "triton": triton.__version__,
        "copy_bandwidth_bytes_per_s": bw, "seconds": time.time() - started, "kv_heads": HK, "rows": rows,
        **({"prefill_sweep_fastest": table} if args.prefill_sweep else {}),
    }
    path = os.path.join(out_dir, "gpu_kernels_smoke.json" if SMOKE else "gpu_kernels.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print_table()
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
