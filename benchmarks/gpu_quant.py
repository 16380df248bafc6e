"""Weight-only int8 / int4 Triton kernels against torch bf16 matmul on Llama-3.1-8B layer shapes (GPU).

For each projection (qkv, o, gate_up, down) and M = 1..256 rows: correctness of the int8 and int4
(group 128) kernels against x @ dequantized(W)^T in float32, their time and torch's bf16 F.linear
time, and the bytes floor (weight bytes / HBM bandwidth). Then a tile-size sweep for the decode
GEMV (M = 1), and the linear-layers-only decode bound in tokens per second for the 32-layer model.
Writes $OUT/gpu_quant.json (or --output).  Usage: python benchmarks/gpu_quant.py [--bandwidth 3.01e12]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from goodserve.quant import schemes
from goodserve.quant.triton_kernels import int4_matmul, int8_matmul

LLAMA_8B = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
            "down_proj": (4096, 14336)}
NUM_LAYERS = 32
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
GROUP = 128


def weight_bytes(n: int, k: int, kind: str) -> int:
    if kind == "bf16":
        return 2 * n * k
    if kind == "int8":
        return n * k + 4 * n
    return n * k // 2 + 2 * 4 * n * (k // GROUP)


def time_us(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def measure_layer(n: int, k: int, bandwidth: float) -> list[dict]:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    q8, q4 = schemes.quantize_int8(w), schemes.quantize_int4(w, GROUP)
    deq8, deq4 = schemes.dequantize_int8(q8), schemes.dequantize_int4(q4)
    rows = []
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        fns = {"bf16": lambda: F.linear(x, w),
               "int8": lambda: int8_matmul(x, q8.qweight, q8.scales),
               "int4": lambda: int4_matmul(x, q4.qweight, q4.scales, q4.zeros, GROUP)}
        row = {"M": m,
               "int8_rel_error": relative_error(fns["int8"](), x.float() @ deq8.T),
               "int4_rel_error": relative_error(fns["int4"](), x.float() @ deq4.T)}
        for kind, fn in fns.items():
            t = time_us(fn)
            floor = weight_bytes(n, k, kind) / bandwidth * 1e6
            row[f"{kind}_us"] = round(t, 2)
            row[f"{kind}_floor_us"] = round(floor, 2)
            row[f"{kind}_of_floor"] = round(floor / t, 3)  # 1.0 = at the bandwidth limit
        rows.append(row)
    return rows


def sweep_gemv(n: int, k: int) -> list[dict]:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    q8, q4 = schemes.quantize_int8(w), schemes.quantize_int4(w, GROUP)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    out = []
    for block_n in (8, 16, 32, 64):
        for block_k in (64, 128, 256, 512):
            out.append({"kind": "int8", "block_n": block_n, "block_k": block_k,
                        "us": round(time_us(lambda: int8_matmul(x, q8.qweight, q8.scales,
                                                                block_n=block_n, block_k=block_k)), 2)})
        out.append({"kind": "int4", "block_n": block_n, "block_k": GROUP,
                    "us": round(time_us(lambda: int4_matmul(x, q4.qweight, q4.scales, q4.zeros, GROUP,
                                                            block_n=block_n)), 2)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bandwidth", type=float, default=3.01e12, help="bytes/s (H100 D2D copy measured)")
    parser.add_argument("--output", default=str(Path(os.environ.get("OUT", ".")) / "gpu_quant.json"))
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    layers = {name: {"N": n, "K": k, "rows": measure_layer(n, k, args.bandwidth)} for name, (n, k) in LLAMA_8B.items()}
    decode = {}
    for kind in ("bf16", "int8", "int4"):
        per_token_us = NUM_LAYERS * sum(layer["rows"][0][f"{kind}_us"] for layer in layers.values())
        decode[kind] = {"linear_us_per_token": round(per_token_us, 1),
                        "tok_per_s_bound_linears_only": round(1e6 / per_token_us, 1)}
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "group_size": GROUP,
              "bandwidth_bytes_per_s": args.bandwidth, "layers": layers, "decode_batch1": decode,
              "gemv_sweep": {} if args.no_sweep else {name: sweep_gemv(n, k) for name, (n, k) in LLAMA_8B.items()}}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2))
    for name, layer in layers.items():
        for row in layer["rows"]:
            print(name, json.dumps(row))
    print("decode batch 1 (linears only):", json.dumps(decode))
    print("wrote", args.output)


if __name__ == "__main__":
    main()
