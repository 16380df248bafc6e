"""GPU check and timing of goodserve's Triton kernels against the plain-torch references.

For each kernel: relative error against the torch reference in bf16 on fresh random inputs, and the
median time (triton.testing.do_bench) against the bytes-moved floor at the device-to-device copy
bandwidth measured in the same run. Shapes are a Llama-3.1-8B layer (32 q heads, 8 kv heads,
head_dim 128, hidden 4096, intermediate 14336), KV block size 16.

    python benchmarks/gpu_kernels.py            # writes $OUT/gpu_kernels.json (OUT defaults to ./out)
    python benchmarks/gpu_kernels.py --quick    # fewer shapes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    sys.exit("benchmarks/gpu_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False)")

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from goodserve.ops.activation import silu_and_mul_torch  # noqa: E402
from goodserve.ops.attention import (  # noqa: E402
    AttentionMetadata, LayerKVCache, decode_attention_torch, paged_attention_reference, write_kv_torch,
)
from goodserve.ops.norm import add_rms_norm_torch  # noqa: E402
from goodserve.ops.rotary import apply_rotary_torch, cos_sin_cache  # noqa: E402
from goodserve.ops.triton_attention import (  # noqa: E402
    default_num_splits, triton_decode_attention, triton_prefill_attention, triton_write_kv,
)
from goodserve.ops.triton_ops import triton_add_rms_norm, triton_rotary, triton_silu_and_mul  # noqa: E402

DEVICE = torch.device("cuda")
HQ, HK, D, HIDDEN, INTER, BLOCK = 32, 8, 128, 4096, 14336, 16
BF16 = torch.bfloat16
rows: list[dict] = []


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12)).item()


def bench_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def record(kernel: str, shape: str, ms: float, nbytes: float, bw: float, err: float | None = None,
           torch_ms: float | None = None, flops: float | None = None, **extra) -> None:
    row = {"kernel": kernel, "shape": shape, "ms": ms, "bytes": nbytes, "floor_ms": nbytes / bw * 1e3,
           "bw_fraction": nbytes / bw / (ms * 1e-3), "rel_err": err, "torch_ms": torch_ms, **extra}
    if flops is not None:
        row["tflops"] = flops / (ms * 1e-3) / 1e12
    rows.append(row)
    print(f"  {kernel:16s} {shape:34s} {ms:8.4f} ms  {row['bw_fraction']:6.1%} of copy bw"
          + (f"  err {err:.2e}" if err is not None else "") + (f"  torch {torch_ms:.4f} ms" if torch_ms else ""),
          flush=True)


# ---------------------------------------------------------------------------------------------
# Paged batches


def make_paged(batch: int, q_lens: list[int], seq_lens: list[int], kv_dtype: torch.dtype, seed: int):
    """Random K/V for every sequence's whole context, in shuffled blocks; q for the new tokens."""
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
    table = torch.zeros(batch, max(blocks), dtype=torch.int32, device=DEVICE)
    start = 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[start : start + n]
        start += n
    q = torch.randn(sum(q_lens), HQ, D, device=DEVICE, generator=gen).to(BF16)
    meta = AttentionMetadata(
        slot_mapping=torch.full((sum(q_lens),), -1, dtype=torch.int64, device=DEVICE),
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
        part = AttentionMetadata(meta.slot_mapping[i : i + 8], meta.query_start_loc[: len(lens) + 1],
                                 meta.seq_lens[i : i + 8], meta.block_tables[i : i + 8], 1, max(lens),
                                 [1] * len(lens), lens)
        outs.append(decode_attention_torch(q[i : i + 8], cache, part, D**-0.5))
    return torch.cat(outs)


def bench_decode(bw: float, batches: list[int], contexts: list[int]) -> None:
    print("decode attention (one query per sequence)")
    for batch in batches:
        for ctx in contexts:
            if batch * ctx > 64 * 32768:
                continue
            q, cache, meta = make_paged(batch, [1] * batch, [ctx] * batch, BF16, seed=batch + ctx)
            out = triton_decode_attention(q, cache, meta.block_tables, meta.seq_lens, D**-0.5)
            ref = decode_reference(q, cache, meta)
            ms = bench_ms(lambda: triton_decode_attention(q, cache, meta.block_tables, meta.seq_lens, D**-0.5))
            torch_ms = bench_ms(lambda: decode_attention_torch(q, cache, meta, D**-0.5)) if batch * ctx <= 8 * 8192 else None
            splits = default_num_splits(batch, HK, meta.block_tables.shape[1] * BLOCK, DEVICE)
            record("decode", f"B={batch} ctx={ctx} splits={splits}", ms, kv_bytes(cache, batch * ctx), bw,
                   rel_err(out, ref), torch_ms)
            del q, cache, meta, out, ref
            torch.cuda.empty_cache()


def bench_decode_cache_dtypes(bw: float) -> None:
    print("decode attention, quantized caches")
    for kv_dtype in (torch.int8, torch.float8_e4m3fn):
        q, cache, meta = make_paged(8, [1] * 8, [8192] * 8, kv_dtype, seed=7)
        out = triton_decode_attention(q, cache, meta.block_tables, meta.seq_lens, D**-0.5)
        ref = decode_reference(q, cache, meta)
        ms = bench_ms(lambda: triton_decode_attention(q, cache, meta.block_tables, meta.seq_lens, D**-0.5))
        record("decode", f"B=8 ctx=8192 kv={str(kv_dtype)[6:]}", ms, kv_bytes(cache, 8 * 8192), bw, rel_err(out, ref))


def sweep_decode_tuning(bw: float) -> None:
    """Which launch settings come closest to the bandwidth floor (DECODE_TUNING holds the default)."""
    print("decode tuning sweep")
    for batch, ctx in ((1, 32768), (64, 2048)):
        q, cache, meta = make_paged(batch, [1] * batch, [ctx] * batch, BF16, seed=3)
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    tuning = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
                    try:
                        ms = bench_ms(lambda: triton_decode_attention(
                            q, cache, meta.block_tables, meta.seq_lens, D**-0.5, tuning=tuning))
                    except Exception as e:  # e.g. out of shared memory: report, keep sweeping
                        print(f"  {tuning}: {type(e).__name__}")
                        continue
                    record("decode-tune", f"B={batch} ctx={ctx} n{block_n} w{warps} s{stages}", ms,
                           kv_bytes(cache, batch * ctx), bw, tuning=tuning)


def check_decode_cuda_graph() -> None:
    """Capture decode once, grow the sequences in place, replay: the result must follow the new lengths."""
    print("decode attention under a CUDA graph")
    q, cache, meta = make_paged(4, [1] * 4, [4096] * 4, BF16, seed=11)
    meta.seq_lens.copy_(torch.tensor([100, 700, 1500, 2000], dtype=torch.int32))
    args = (q, cache, meta.block_tables, meta.seq_lens, D**-0.5)
    torch.cuda.synchronize()
    triton_decode_attention(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_decode_attention(*args)
    new_lens = [4096, 3000, 17, 2500]
    meta.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
    graph.replay()
    meta.seq_lens_host, meta.max_seq_len = new_lens, max(new_lens)
    err = rel_err(out, paged_attention_reference(q, cache, meta, D**-0.5))
    rows.append({"kernel": "decode-cuda-graph", "shape": "B=4 lens changed after capture", "rel_err": err})
    print(f"  replay after changing seq_lens: rel err {err:.2e}")


def bench_prefill(bw: float) -> None:
    print("prefill attention (varlen, causal, paged)")
    cases = [("2K prompt", [2048], [2048]), ("4 x 512 prompts", [512] * 4, [512] * 4),
             ("512 chunk on 8K ctx", [512], [8192]), ("mixed 1K prefill + 32 decodes", [1024] + [1] * 32,
                                                      [1024] + [2048] * 32)]
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


# ---------------------------------------------------------------------------------------------
# write_kv and the small fused ops


def bench_write_kv(bw: float) -> None:
    print("write_kv")
    tokens = 2048
    for kv_dtype in (BF16, torch.int8, torch.float8_e4m3fn):
        k, v = torch.randn(2, tokens, HK, D, device=DEVICE).to(BF16)
        num_blocks = tokens // BLOCK + 8
        slots = torch.randperm(num_blocks * BLOCK, device=DEVICE)[:tokens]
        slots[::7] = -1

        def fresh() -> LayerKVCache:
            shape = (num_blocks, BLOCK, HK, D)
            pools = [torch.zeros(shape, dtype=kv_dtype, device=DEVICE) for _ in range(2)]
            scales = [torch.zeros(shape[:3], device=DEVICE) for _ in range(2)] if kv_dtype == torch.int8 else []
            return LayerKVCache(*pools, *scales)

        ours, ref = fresh(), fresh()
        triton_write_kv(k, v, ours, slots)
        write_kv_torch(k, v, ref, slots)
        mismatched = (ours.k.view(torch.uint8) != ref.k.view(torch.uint8)).float().mean().item() \
            if kv_dtype != BF16 else (ours.k != ref.k).float().mean().item()
        ms = bench_ms(lambda: triton_write_kv(k, v, ours, slots))
        torch_ms = bench_ms(lambda: write_kv_torch(k, v, ours, slots))
        nbytes = 2 * k.numel() * 2 + kv_bytes(ours, tokens)
        record("write_kv", f"T={tokens} kv={str(kv_dtype)[6:]}", ms, nbytes, bw, None, torch_ms,
               mismatch_fraction=mismatched)


def bench_small_ops(bw: float) -> None:
    print("fused small ops")
    for tokens in (64, 2048):
        x, residual = torch.randn(2, tokens, HIDDEN, device=DEVICE).to(BF16)
        weight = (1 + 0.1 * torch.randn(HIDDEN, device=DEVICE)).to(BF16)
        normed, new_res = triton_add_rms_norm(x, residual, weight, 1e-5)
        ref_normed, ref_res = add_rms_norm_torch(x, residual, weight, 1e-5)
        err = max(rel_err(normed, ref_normed), rel_err(new_res, ref_res))
        record("add_rms_norm", f"T={tokens} H={HIDDEN}", bench_ms(lambda: triton_add_rms_norm(x, residual, weight, 1e-5)),
               5 * x.numel() * 2, bw, err, bench_ms(lambda: add_rms_norm_torch(x, residual, weight, 1e-5)))

        qkv = torch.randn(tokens, (HQ + 2 * HK) * D, device=DEVICE).to(BF16)
        q = qkv[:, : HQ * D].view(tokens, HQ, D)
        k = qkv[:, HQ * D : (HQ + HK) * D].view(tokens, HK, D)
        positions = torch.randint(0, 8192, (tokens,), device=DEVICE)
        table = cos_sin_cache(D, 8192, 500000.0, None).to(DEVICE)
        out_q, out_k = triton_rotary(q, k, positions, table)
        ref_q, ref_k = apply_rotary_torch(q, k, positions, table)
        err = max(rel_err(out_q, ref_q), rel_err(out_k, ref_k))
        record("rotary", f"T={tokens} q32 k8 d128", bench_ms(lambda: triton_rotary(q, k, positions, table)),
               2 * (q.numel() + k.numel()) * 2 + tokens * D * 4, bw, err,
               bench_ms(lambda: apply_rotary_torch(q, k, positions, table)))

        gate_up = torch.randn(tokens, 2 * INTER, device=DEVICE).to(BF16)
        err = rel_err(triton_silu_and_mul(gate_up), silu_and_mul_torch(gate_up))
        record("silu_and_mul", f"T={tokens} I={INTER}", bench_ms(lambda: triton_silu_and_mul(gate_up)),
               gate_up.numel() * 2 * 3 // 2, bw, err, bench_ms(lambda: silu_and_mul_torch(gate_up)))


# ---------------------------------------------------------------------------------------------


def print_table() -> None:
    print(f"\n{'kernel':18s} {'shape':36s} {'ms':>9s} {'floor ms':>9s} {'bw%':>6s} {'TFLOP/s':>8s} {'torch ms':>9s} {'rel err':>9s}")
    for r in rows:
        if r["kernel"] == "decode-tune":
            continue
        fmt = lambda key, spec: format(r[key], spec) if r.get(key) is not None else "-"  # noqa: E731
        print(f"{r['kernel']:18s} {r['shape']:36s} {fmt('ms', '9.4f'):>9s} {fmt('floor_ms', '9.4f'):>9s} "
              f"{(format(100 * r['bw_fraction'], '5.1f') if 'bw_fraction' in r else '-'):>6s} "
              f"{fmt('tflops', '8.1f'):>8s} {fmt('torch_ms', '9.4f'):>9s} {fmt('rel_err', '9.2e'):>9s}")
    tuned = [r for r in rows if r["kernel"] == "decode-tune"]
    for shape in sorted({r["shape"].rsplit(" n", 1)[0] for r in tuned}):
        best = min((r for r in tuned if r["shape"].startswith(shape + " n")), key=lambda r: r["ms"])
        print(f"best decode tuning for {shape}: {best['tuning']} {best['ms']:.4f} ms ({best['bw_fraction']:.1%} of copy bw)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes, no tuning sweep")
    args = parser.parse_args()
    torch.manual_seed(0)
    started = time.time()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {bw / 1e12:.2f} TB/s")
    contexts = [512, 4096, 32768] if args.quick else [512, 2048, 8192, 32768]
    bench_decode(bw, [1, 8, 64], contexts)
    bench_decode_cache_dtypes(bw)
    check_decode_cuda_graph()
    bench_prefill(bw)
    bench_write_kv(bw)
    bench_small_ops(bw)
    if not args.quick:
        sweep_decode_tuning(bw)
    out_dir = os.environ.get("OUT", "./out")
    os.makedirs(out_dir, exist_ok=True)
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "copy_bandwidth_bytes_per_s": bw, "seconds": time.time() - started, "rows": rows,
    }
    path = os.path.join(out_dir, "gpu_kernels.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print_table()
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
