"""CPU paths for weight-only quantized linears: which is fastest at which batch size M.

Compares, per layer shape of smollm2-135m (the default CPU model) and one Llama-3.1-8B shape:
dense float32 F.linear, torch's packed int8 / int4 kernels, the int4 kernel on bfloat16-rounded
rows as the GGUF layers run it (group 32), and dequantize-then-F.linear.
Result: benchmarks/results/cpu_quant_linear.json; linear.py's CPU_PACKED_MAX_M and
CPU_BF16_KERNEL_MAX_M come from it.
Timings are medians of repeated calls; the machine is shared, so compare columns, not runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from goodserve.quant.linear import Int4Linear, Int8Linear

SHAPES = {  # name: (out_features N, in_features K)
    "smollm2.qkv_proj": (960, 576),
    "smollm2.gate_up_proj": (3072, 576),
    "smollm2.down_proj": (576, 1536),
    "llama8b.o_proj": (4096, 4096),
}


def median_us(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure_shape(n: int, k: int, ms: list[int], repeats: int) -> list[dict]:
    linear = nn.Linear(k, n, bias=False)
    int8, int4 = Int8Linear.from_linear(linear), Int4Linear.from_linear(linear, group_size=64)
    gguf_like = Int4Linear.from_linear(linear, group_size=32)
    gguf_like.bf16_cpu_kernel = True
    rows = []
    for m in ms:
        x = torch.randn(m, k)
        with torch.inference_mode():
            paths = {
                "fp32_dense": lambda: F.linear(x, linear.weight),
                "int8_packed_kernel": lambda: int8._cpu_packed_matmul(x),
                "int8_dequant_dense": lambda: F.linear(x, int8.dequantize(x.dtype)),
                "int4_packed_kernel": lambda: int4._cpu_packed_matmul(x),
                "int4_dequant_dense": lambda: F.linear(x, int4.dequantize(x.dtype)),
                "int4_g32_bf16_kernel": lambda: gguf_like._cpu_packed_matmul(x),
                "int4_g32_dequant_dense": lambda: F.linear(x, gguf_like.dequantize(x.dtype)),
            }
            rows.append({"M": m, **{name: round(median_us(fn, repeats), 1) for name, fn in paths.items()}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "cpu_quant_linear.json"))
    args = parser.parse_args()
    ms = [1, 2, 4, 8, 16, 32, 64, 128, 512]
    result = {
        "machine": {"processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "unit": "microseconds per call (median)",
        "shapes": {name: {"N": n, "K": k, "rows": measure_shape(n, k, ms, args.repeats)}
                   for name, (n, k) in SHAPES.items()},
    }
    Path(args.output).write_text(json.dumps(result, indent=2))
    for name, shape in result["shapes"].items():
        print(name, json.dumps(shape["rows"]))


if __name__ == "__main__":
    main()
