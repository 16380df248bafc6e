"""Weight-only int8 / int4 decode paths against torch bf16 on Llama-3.1-8B layer shapes (GPU).

Paths, each timed at M = 1..16 decode rows (and 64 / 256 for the prefill side):
  bf16           torch F.linear on the bf16 weight (the baseline)
  int8           Int8Linear: the split-K Triton GEMV for M <= 16, the Triton GEMM above
  int4_triton    the Triton int4 kernels (the fallback path)
  int4_tinygemm  Int4Linear with bf16 activations: torch's _weight_int4pack_mm on the repacked codes
For each: relative error against x @ dequantized(W)^T in float32, time per call and the bytes floor
(weight bytes / HBM bandwidth). Times come from a CUDA graph that cycles through enough copies of
the layer to overflow L2 (as a decode step streams every layer from HBM) and has no launch gaps
(as the engine's captured decode); `timing` says where a path fell back to triton's do_bench.
Then a small int8 GEMV tile sweep and the linears-only decode bound for the 32-layer model. A path
that fails is recorded with its error and the run goes on. Writes $OUT/gpu_quant.json (or
--output) and prints a summary table last.  Usage: python benchmarks/gpu_quant.py [--no-sweep]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from triton.testing import do_bench

from goodserve.quant.linear import Int4Linear, Int8Linear
from goodserve.quant.triton_kernels import int4_matmul, int8_matmul

LLAMA_8B = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
            "down_proj": (4096, 14336)}
NUM_LAYERS = 32
ROWS = [1, 2, 4, 8, 16, 64, 256]
GROUP = 128
PATHS = ("bf16", "int8", "int4_triton", "int4_tinygemm")
FLUSH_BYTES = 256 << 20  # > 5x the H100's 50 MB L2: each call finds its weight in HBM
CALLS_PER_GRAPH = 64
GRAPH_REPLAYS = 10
OK_REL_ERROR = 0.01  # bf16 outputs of a right kernel land near 0.003
SWEEP_LAYERS = ("o_proj", "down_proj")
SWEEP_TILES = {1: [(16, 256), (16, 512), (32, 256), (32, 512), (64, 256), (8, 512)],
               16: [(32, 128), (32, 256), (64, 128), (64, 256)]}
SWEEP_DEADLINE_S = 80  # skip the sweep past this, to keep the whole run near two minutes


def weight_bytes(n: int, k: int, path: str) -> int:
    groups = n * (k // GROUP)
    return {"bf16": 2 * n * k, "int8": n * k + 4 * n,
            "int4_triton": n * k // 2 + 2 * 4 * groups,  # fp32 scales and zeros
            "int4_tinygemm": n * k // 2 + 2 * 2 * groups}[path]  # bf16 scales and zeros


def graph_time_us(calls: list[Callable[[], object]]) -> tuple[float, str]:
    """Median time of one call, the calls cycled inside a CUDA graph; do_bench where capture fails."""
    torch.cuda.synchronize()
    loops = math.ceil(CALLS_PER_GRAPH / len(calls))
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(loops):
                for call in calls:
                    call()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(GRAPH_REPLAYS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / (loops * len(calls)))
        return statistics.median(times), "cuda_graph"
    except Exception:  # noqa: BLE001 - measure what we can; the method is recorded
        torch.cuda.synchronize()
        return do_bench(calls[0], warmup=10, rep=50, return_mode="median") * 1e3, "do_bench"


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@torch.no_grad()
def build_paths(n: int, k: int) -> tuple[dict, dict, dict, list]:
    """Per path: calls (one per layer copy, taking x) and the float32 reference weight; per path
    errors; and the tinygemm path's layers (to see whether they fell back to Triton)."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    linear = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    linear.weight.copy_(w)
    copies = {path: max(1, math.ceil(FLUSH_BYTES / weight_bytes(n, k, path))) for path in PATHS}
    calls, refs, errors, tinygemm_layers = {}, {}, {}, []
    for path in PATHS:
        try:
            if path == "bf16":
                calls[path] = [lambda x, c=w.clone(): F.linear(x, c) for _ in range(copies[path])]
                refs[path] = w.float()
                continue
            layer = Int8Linear.from_linear(linear) if path == "int8" else Int4Linear.from_linear(linear, GROUP)
            layers = [layer] + [copy.deepcopy(layer) for _ in range(copies[path] - 1)]
            refs[path] = layer.dequantize(torch.float32)
            if path == "int4_triton":
                calls[path] = [lambda x, m=m: int4_matmul(x, m.qweight, m.scales, m.zeros, GROUP) for m in layers]
            else:
                calls[path] = [lambda x, m=m: m(x) for m in layers]
            if path == "int4_tinygemm":
                tinygemm_layers = layers
        except Exception as exc:  # noqa: BLE001
            errors[path] = f"build: {type(exc).__name__}: {exc}"[:300]
    return calls, refs, errors, tinygemm_layers


def measure_layer(n: int, k: int, bandwidth: float) -> list[dict]:
    calls, refs, build_errors, tinygemm_layers = build_paths(n, k)
    rows = []
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row = {"M": m}
        with torch.inference_mode():
            _measure_rows(row, x, n, k, bandwidth, calls, refs, build_errors, tinygemm_layers)
        rows.append(row)
    del calls, refs, tinygemm_layers
    torch.cuda.empty_cache()
    return rows


def _measure_rows(row: dict, x: torch.Tensor, n: int, k: int, bandwidth: float, calls: dict, refs: dict,
                  build_errors: dict, tinygemm_layers: list) -> None:
    for path in PATHS:
        floor = weight_bytes(n, k, path) / bandwidth * 1e6
        entry = {"floor_us": round(floor, 2)}
        row[path] = entry
        if path in build_errors:
            entry["error"] = build_errors[path]
            continue
        try:
            out = calls[path][0](x)
            for call in calls[path][1:]:
                call(x)  # compile / repack every copy before capture
            if path == "int4_tinygemm" and any(m.tinygemm_disabled for m in tinygemm_layers):
                raise RuntimeError("tinygemm disabled itself (see the warning printed); Triton served")
            entry["rel_error"] = relative_error(out, x.float() @ refs[path].T)
            t, method = graph_time_us([lambda c=c: c(x) for c in calls[path]])
            entry.update(us=round(t, 2), of_floor=round(floor / t, 3), timing=method)
        except Exception as exc:  # noqa: BLE001
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
            torch.cuda.synchronize()


@torch.inference_mode()
def _sweep_calls(x: torch.Tensor, copies: list, block_n: int, block_k: int, split_k: int | None) -> float:
    calls = [lambda q=q: int8_matmul(x, q.qweight, q.scales, block_n=block_n, block_k=block_k, split_k=split_k)
             for q in copies]
    for call in calls:
        call()
    return round(graph_time_us(calls)[0], 2)


def sweep_int8_gemv(n: int, k: int) -> list[dict]:
    with torch.no_grad():
        module = Int8Linear.from_linear(nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
        copies = [module] + [copy.deepcopy(module) for _ in range(max(0, FLUSH_BYTES // (n * k) - 1))]
    out = []
    for m, tiles in SWEEP_TILES.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for block_n, block_k in tiles:
            for split_k in (None, 1):
                entry = {"M": m, "block_n": block_n, "block_k": block_k, "split_k": split_k or "auto"}
                try:
                    entry["us"] = _sweep_calls(x, copies, block_n, block_k, split_k)
                except Exception as exc:  # noqa: BLE001
                    entry["error"] = f"{type(exc).__name__}: {exc}"[:200]
                out.append(entry)
    return out


def decode_bound(layers: dict) -> dict:
    bound = {}
    for path in PATHS:
        per_layer = [layer["rows"][0][path].get("us") for layer in layers.values()]
        if None in per_layer:
            bound[path] = "incomplete"
            continue
        per_token = NUM_LAYERS * sum(per_layer)
        bound[path] = {"linear_us_per_token": round(per_token, 1), "tok_per_s_bound_linears_only": round(1e6 / per_token, 1)}
    return bound


def print_table(layers: dict) -> None:
    print(f"\n{'layer':<13}{'M':>4}" + "".join(f"{p + ' us (floor%)':>28}" for p in PATHS))
    for name, layer in layers.items():
        for row in layer["rows"]:
            cells = []
            for path in PATHS:
                e = row[path]
                if "error" in e:
                    cells.append("ERROR".rjust(28))
                    continue
                flag = "" if e["rel_error"] < OK_REL_ERROR else f" BAD err {e['rel_error']:.2g}"
                cells.append(f"{e['us']:.1f} ({100 * e['of_floor']:.0f}%){flag}".rjust(28))
            print(f"{name:<13}{row['M']:>4}" + "".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bandwidth", type=float, default=3.01e12, help="bytes/s (H100 D2D copy measured)")
    parser.add_argument("--output", default=str(Path(os.environ.get("OUT", ".")) / "gpu_quant.json"))
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("goodserve.quant").addHandler(handler)
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    began = time.monotonic()
    layers = {}
    for name, (n, k) in LLAMA_8B.items():
        layers[name] = {"N": n, "K": k, "rows": measure_layer(n, k, args.bandwidth)}
        print(name, "done", f"{time.monotonic() - began:.0f}s", flush=True)
    sweep = {}
    if not args.no_sweep and time.monotonic() - began < SWEEP_DEADLINE_S:
        sweep = {name: sweep_int8_gemv(*LLAMA_8B[name]) for name in SWEEP_LAYERS}
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "group_size": GROUP,
              "bandwidth_bytes_per_s": args.bandwidth, "layers": layers, "decode_batch1": decode_bound(layers),
              "int8_gemv_sweep": sweep, "warnings": warnings, "seconds": round(time.monotonic() - began, 1)}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2))
    for name, entries in sweep.items():
        best = {m: min((e for e in entries if e["M"] == m and "us" in e), key=lambda e: e["us"], default=None)
                for m in SWEEP_TILES}
        print("int8 GEMV sweep best", name, json.dumps(best))
    for message in warnings:
        print("WARNING:", message)
    errors = {(path, row[path]["error"]) for layer in layers.values() for row in layer["rows"]
              for path in PATHS if "error" in row[path]}
    for path, message in sorted(errors):
        print(f"ERROR {path}: {message}")
    print("wrote", args.output, f"in {report['seconds']}s")
    print("decode batch 1 (linears only):", json.dumps(report["decode_batch1"]))
    print_table(layers)


if __name__ == "__main__":
    main()
