"""Decode-sized matmuls at a model's shapes (Llama-3.1-8B's, or --model PRESET's: qwen3-8b; for a
mixture of experts such as qwen3-30b-a3b, its attention, router and lm_head): cuBLAS bf16 against
the Triton GEMV family (ops/triton_gemv.py: dense, int8, int4) and torch's int4 tinygemm, plus a
config sweep for the GEMV's table of tuned configs.

Paths, for each shape (qkv, o_proj, gate_up, down, lm_head) and M in --rows (default 1, 4, 16):
  cublas_bf16     F.linear on the bf16 weight
  triton_dense    dense_gemv on the same weight (M <= 16)
  triton_int8     int8_matmul: per-channel codes (quant/triton_kernels.py)
  triton_int4     int4_matmul: our packed codes, group 128
  tinygemm_int4   torch.ops.aten._weight_int4pack_mm on quant/linear.tinygemm_layout, as Int4Linear uses it
Each is timed in a CUDA graph that cycles through copies of its weight totalling >= 256 MB (five
times the H100's L2), so every call streams its weight from HBM, with no launch gaps (as the
engine's captured decode step). Reported per path: us per call; of_floor = (weight + scale bytes)
/ 3.0e12 B/s / time; of_copy, the same against the device-to-device copy bandwidth measured here;
rel_error against x @ W^T in float32 with W the weight the path stands for (dequantized codes).
Then the linears-only batch-1 decode bound of the whole model (its layer count) for each scheme.

--sweep: for each shape at M = 1 and M = 16 and each Triton format, a coordinate descent over
(block_m, block_n, block_k, num_warps, num_stages, split_k) from the config in use; prints the
winners as TUNED_CONFIGS lines to paste into ops/triton_gemv.py. --sweep-budget-s bounds it.
--tensor-parallel N: one rank's shards at TP=N instead (qkv, gate_up and lm_head split along N, o
and down along K, as model/tensor_parallel.py splits them): the shapes a TP=N decode step runs, which
have no tuned entry of their own, so ops/gemv_linear.py leaves them on cuBLAS until one is added.
--smoke: CPU, TRITON_INTERPRET=1, tiny shapes, no graphs: catches Python errors.

    PYTHONPATH=src python3 benchmarks/gpu_gemv.py [--sweep]    # writes $OUT/gpu_gemv.json (OUT: ./out)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, so before importing them

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from goodserve.model.presets import get_preset  # noqa: E402
from goodserve.ops import triton_gemv  # noqa: E402
from goodserve.ops.pdl import device_supports_pdl  # noqa: E402
from goodserve.ops.triton_gemv import GemvConfig, dense_gemv  # noqa: E402
from goodserve.quant import schemes  # noqa: E402
from goodserve.quant.linear import tinygemm_layout  # noqa: E402
from goodserve.quant.triton_kernels import int4_matmul, int8_matmul  # noqa: E402



def model_shapes(preset: str) -> tuple[dict[str, tuple[int, int]], int]:
    """A preset's (N, K) per linear layer a decode token reads whole, and its number of layers. A mixture
    of experts has its router in place of the MLP (the experts run in the fused MoE kernel: gpu_moe.py)."""
    spec = get_preset(preset)
    q, kv, hidden = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden_size
    shapes = {"qkv_proj": (q + 2 * kv, hidden), "o_proj": (hidden, q)}
    if spec.is_moe:
        shapes["router"] = (spec.num_experts, hidden)
    else:
        shapes |= {"gate_up_proj": (2 * spec.intermediate_size, hidden), "down_proj": (hidden, spec.intermediate_size)}
    return shapes | {"lm_head": (spec.vocab_size, hidden)}, spec.num_layers


SHAPES, NUM_LAYERS = model_shapes("llama-3.1-8b")
SMOKE_SHAPES = {"qkv_proj": (96, 256), "o_proj": (64, 256), "gate_up_proj": (160, 256), "down_proj": (64, 512),
                "lm_head": (200, 256)}
ROW_PARALLEL = ("o_proj", "down_proj")  # a rank holds a slice of their input columns
GROUP = 128
SMOKE_GROUP = 64
PATHS = ("cublas_bf16", "triton_dense", "triton_int8", "triton_int4", "tinygemm_int4")
FORMAT_OF = {"triton_dense": "dense", "triton_int8": "int8", "triton_int4": "int4"}
# The kernels launch as the engine launches them on this GPU: with PDL where it has it (ops/pdl.py).
PDL = not SMOKE and device_supports_pdl(torch.cuda.current_device())
PEAK_BYTES_PER_S = 3.0e12  # H100 SXM HBM3
FLUSH_BYTES = 256 << 20
CALLS_PER_GRAPH = 64
GRAPH_REPLAYS = 10
SWEEP_REPLAYS = 5
OK_REL_ERROR = 0.01  # bf16 outputs of a right kernel land near 0.003 (tinygemm's bf16 scales: 0.003)
# Sweep candidates per knob, by block_m where they differ. Tile knobs let default_config's rule
# recompute split_k for the tile until the split_k step (runtime only: no compile). num_stages
# pipelines only the tensor-core path's loads (block_m 16), so the one-row path skips it.
SWEEP_KNOBS = {
    "block_n": {1: [8, 16, 32, 64], 16: [16, 32, 64, 128]},
    "block_k": {"dense": [64, 128, 256, 512], "int8": [128, 256, 512, 1024], "int4": [128, 256, 512]},
    "num_warps": [1, 2, 4, 8],
    "num_stages": {1: [], 16: [2, 3, 4]},
    "split_k": [1, 2, 3, 4, 6, 8, 12, 16],
}
SWEEP_ROWS = (1, 16)
SWEEP_FORMATS = ("int8", "int4", "dense")


# ---------------------------------------------------------------------------------------------
# Timing


def graph_time_us(calls: list[Callable[[], object]], replays: int = GRAPH_REPLAYS) -> float:
    """Median time of one call, the calls cycled back to back inside a CUDA graph."""
    if SMOKE:  # the interpreter: a wall-clock pass, only to exercise the code
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) * 1e6 / len(calls)
    loops = math.ceil(CALLS_PER_GRAPH / len(calls))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(loops):
            for call in calls:
                call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (loops * len(calls)))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy bytes per second (read + write), 1 GiB buffers."""
    if SMOKE:
        return PEAK_BYTES_PER_S
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    us = graph_time_us([lambda: dst.copy_(src)])
    return 2 * src.numel() / (us * 1e-6)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


# ---------------------------------------------------------------------------------------------
# Weights and paths


@dataclasses.dataclass
class Layer:
    """One shape's weight in every format, each with enough copies to stream from HBM."""

    n: int
    k: int
    group: int
    copies: dict[str, list[tuple]]  # path -> [tensors the call takes]
    refs: dict[str, torch.Tensor]  # path -> float32 weight it stands for
    build_errors: dict[str, str]


def weight_bytes(path: str, n: int, k: int, group: int) -> int:
    groups = n * (k // group)
    return {"cublas_bf16": 2 * n * k, "triton_dense": 2 * n * k, "triton_int8": n * k + 4 * n,
            "triton_int4": n * k // 2 + 8 * groups,  # float32 scales and zeros
            "tinygemm_int4": n * k // 2 + 4 * groups}[path]  # bfloat16 scales and zeros


def _replicate(tensors: tuple, nbytes: int) -> list[tuple]:
    copies = max(1, math.ceil(FLUSH_BYTES / nbytes)) if not SMOKE else 1
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(copies - 1)]


@torch.no_grad()
def build_layer(n: int, k: int, group: int, device: str) -> Layer:
    w = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)
    q8 = schemes.quantize_int8(w)
    q4 = schemes.quantize_int4(w, group)
    tensors = {"cublas_bf16": (w,), "triton_dense": (w,), "triton_int8": (q8.qweight, q8.scales),
               "triton_int4": (q4.qweight, q4.scales, q4.zeros)}
    dense, int4 = w.float(), schemes.dequantize_int4(q4)
    refs = {"cublas_bf16": dense, "triton_dense": dense, "triton_int8": schemes.dequantize_int8(q8),
            "triton_int4": int4, "tinygemm_int4": int4}
    errors = {}
    try:
        tensors["tinygemm_int4"] = tinygemm_layout(q4.qweight, q4.scales, q4.zeros, group)
    except Exception as exc:  # noqa: BLE001 - CPU (smoke), or a torch without the op: recorded
        errors["tinygemm_int4"] = f"{type(exc).__name__}: {exc}"[:200]
    copies = {path: _replicate(t, weight_bytes(path, n, k, group)) for path, t in tensors.items()}
    return Layer(n, k, group, copies, refs, errors)


def path_call(path: str, layer: Layer, tensors: tuple, x: torch.Tensor, **config) -> Callable[[], torch.Tensor]:
    if path == "cublas_bf16":
        return lambda: F.linear(x, tensors[0])
    if path == "triton_dense":
        return lambda: dense_gemv(x, tensors[0], PDL, **config)
    if path == "triton_int8":
        return lambda: int8_matmul(x, *tensors, PDL, **config)
    if path == "triton_int4":
        return lambda: int4_matmul(x, *tensors, layer.group, PDL, **config)
    return lambda: torch.ops.aten._weight_int4pack_mm(x, tensors[0], layer.group, tensors[1])


def time_path(path: str, layer: Layer, x: torch.Tensor, replays: int = GRAPH_REPLAYS, **config) -> tuple[float, float]:
    """(us per call, relative error); the first call compiles and checks, the graph times."""
    calls = [path_call(path, layer, tensors, x, **config) for tensors in layer.copies[path]]
    error = relative_error(calls[0](), x.float() @ layer.refs[path].T)
    for call in calls[1:]:
        call()
    return graph_time_us(calls, replays), error


# ---------------------------------------------------------------------------------------------
# Measurement


def measure_layer(name: str, layer: Layer, rows: list[int], bandwidth: float, device: str) -> list[dict]:
    results = []
    for m in rows:
        x = torch.randn(m, layer.k, device=device, dtype=torch.bfloat16)
        row = {"M": m}
        for path in PATHS:
            floor_us = weight_bytes(path, layer.n, layer.k, layer.group) / PEAK_BYTES_PER_S * 1e6
            entry = row[path] = {"floor_us": round(floor_us, 2)}
            if path in layer.build_errors:
                entry["error"] = layer.build_errors[path]
                continue
            if path == "triton_dense" and m > triton_gemv.GEMV_MAX_M:
                entry["error"] = "GEMV only (M <= 16)"
                continue
            try:
                us, error = time_path(path, layer, x)
            except Exception as exc:  # noqa: BLE001 - one failing path must not end the run
                entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
                continue
            copy_floor = floor_us * PEAK_BYTES_PER_S / bandwidth
            entry.update(us=round(us, 2), of_floor=round(floor_us / us, 3), of_copy=round(copy_floor / us, 3),
                         rel_error=round(error, 5))
        results.append(row)
        print(f"{name} M={m} done", flush=True)
    return results


def decode_bound(layers: dict, num_layers: int) -> dict:
    """Linears-only batch-1 step time per scheme: num_layers x the per-layer linears + lm_head (int8
    for the int4 schemes, as quantize_lm_head does)."""
    schemes_ = {"bf16_cublas": ("cublas_bf16", "cublas_bf16"), "bf16_triton": ("triton_dense", "triton_dense"),
                "int8_triton": ("triton_int8", "triton_int8"), "int4_triton": ("triton_int4", "triton_int8"),
                "int4_tinygemm": ("tinygemm_int4", "triton_int8")}
    bound = {}
    for scheme, (path, head_path) in schemes_.items():
        def us(name: str, p: str) -> float | None:
            row = next((r for r in layers[name]["rows"] if r["M"] == 1), {})
            return row.get(p, {}).get("us")

        per_layer = [us(name, path) for name in layers if name != "lm_head"]
        head = us("lm_head", head_path) if "lm_head" in layers else 0.0  # --shapes without it: left out
        if None in per_layer or head is None:
            bound[scheme] = "incomplete"
            continue
        step = num_layers * sum(per_layer) + head
        bound[scheme] = {"linear_us_per_token": round(step, 1), "tok_per_s_bound": round(1e6 / step, 1)}
    return bound


def int4_faster(layers: dict) -> dict:
    """Per M, the int4 kernel with the smaller total time over the shapes: what to set
    config.KernelOptions.int4_tinygemm_max_m from."""
    totals: dict[int, dict[str, float]] = {}
    for layer in layers.values():
        for row in layer["rows"]:
            for path in ("triton_int4", "tinygemm_int4"):
                t = totals.setdefault(row["M"], {})
                t[path] = t.get(path, 0.0) + row[path].get("us", math.inf)
    return {m: min(t, key=t.get) if min(t.values()) < math.inf else "incomplete" for m, t in totals.items()}


# ---------------------------------------------------------------------------------------------
# Sweep


def _candidates(knob: str, fmt: str, config: GemvConfig, group: int) -> list[dict]:
    if knob == "block_m":
        return [{"block_m": b} for b in (1, 16) if b != config.block_m]
    if knob == "block_n":
        values = SWEEP_KNOBS["block_n"][config.block_m]
    elif knob == "block_k":
        values = [v for v in SWEEP_KNOBS["block_k"][fmt] if v % max(group, 1) == 0]
    elif knob == "num_stages":
        values = SWEEP_KNOBS["num_stages"][config.block_m]
    else:
        values = SWEEP_KNOBS[knob]
    return [{knob: v} for v in values if v != getattr(config, knob)]


def _tile(config: GemvConfig) -> dict:
    """The config's fields but split_k, which the rule then recomputes for the tile."""
    return {f: v for f, v in dataclasses.asdict(config).items() if f != "split_k"}


def sweep_shape(fmt: str, m: int, layer: Layer, device: str, deadline: float) -> dict:
    """Coordinate descent from the config the engine uses now (TUNED_CONFIGS or default_config):
    each knob in turn, keeping the best value."""
    path = {"dense": "triton_dense", "int8": "triton_int8", "int4": "triton_int4"}[fmt]
    group = layer.group if fmt == "int4" else 0
    x = torch.randn(m, layer.k, device=device, dtype=torch.bfloat16)
    sms = triton_gemv.num_sms(torch.device(device))
    tried: dict[GemvConfig, dict] = {}

    def trial(overrides: dict) -> GemvConfig | None:
        try:
            config = triton_gemv.default_config(fmt, m, layer.n, layer.k, group, sms, **overrides)
            triton_gemv._check_config(config, fmt, m, group)
        except ValueError:
            return None
        if config not in tried:
            try:
                us, error = time_path(path, layer, x, SWEEP_REPLAYS, **dataclasses.asdict(config))
                tried[config] = {"us": round(us, 2)} if error < OK_REL_ERROR else {"wrong": round(error, 4)}
            except Exception as exc:  # noqa: BLE001 - a tile the compiler or the GPU refuses
                tried[config] = {"error": f"{type(exc).__name__}: {exc}"[:160]}
        return config

    def us(config: GemvConfig | None) -> float:
        return tried.get(config, {}).get("us", math.inf) if config else math.inf

    current = triton_gemv.gemv_config(fmt, m, layer.n, layer.k, group, torch.device(device))
    start = best = trial(dataclasses.asdict(current))
    for knob in ("block_m", "block_n", "block_k", "num_warps", "num_stages", "split_k"):
        if knob == "block_m" and m > 1:
            continue
        for change in _candidates(knob, fmt, best, group):
            if time.monotonic() > deadline:
                break
            base = {} if knob == "block_m" else (_tile(best) if knob != "split_k" else dataclasses.asdict(best))
            candidate = trial({**base, **change})
            if us(candidate) < us(best):
                best = candidate
    floor_us = weight_bytes(path, layer.n, layer.k, layer.group) / PEAK_BYTES_PER_S * 1e6
    ranked = sorted((c for c in tried if "us" in tried[c]), key=lambda c: tried[c]["us"])
    return {"current": {**dataclasses.asdict(start), **tried.get(start, {})},
            "best": {**dataclasses.asdict(best), **tried.get(best, {}),
                     "of_floor": round(floor_us / us(best), 3) if us(best) < math.inf else None},
            "top": [{**dataclasses.asdict(c), **tried[c]} for c in ranked[:5]],
            "failed": [{**dataclasses.asdict(c), **r} for c, r in tried.items() if "us" not in r],
            "tried": len(tried)}


def tuned_config_lines(sweep: dict, shapes: dict) -> list[str]:
    lines = []
    for (fmt, m, name), result in sweep.items():
        best, current = result["best"], result["current"]
        if "us" not in best:
            continue
        n, k = shapes[name]
        fields = ", ".join(f"{f}={best[f]}" for f in GemvConfig.__dataclass_fields__)
        of_floor = f"{100 * best['of_floor']:.0f}%" if best.get("of_floor") else "?"
        lines.append(f'    ("{fmt}", {m}, {n}, {k}): GemvConfig({fields}),  # {name}: {best["us"]} us, '
                     f'{of_floor} of floor (now {current.get("us", "failed")} us)')
    return lines


# ---------------------------------------------------------------------------------------------


def print_table(layers: dict) -> None:
    width = 26
    print(f"\n{'layer':<13}{'M':>4}" + "".join(f"{p + ' us (floor%)':>{width}}" for p in PATHS))
    for name, layer in layers.items():
        for row in layer["rows"]:
            cells = []
            for path in PATHS:
                e = row[path]
                if "us" not in e:
                    cells.append("-".rjust(width))
                    continue
                flag = "" if e["rel_error"] < OK_REL_ERROR else f" BAD {e['rel_error']:.2g}"
                cells.append(f"{e['us']:.1f} ({100 * e['of_floor']:.0f}%){flag}".rjust(width))
            print(f"{name:<13}{row['M']:>4}" + "".join(cells))


def release(layer: Layer) -> None:
    del layer.copies, layer.refs
    if not SMOKE:
        torch.cuda.empty_cache()


def rank_shape(name: str, shape: tuple[int, int], tp: int) -> tuple[int, int]:
    """(N, K) of one rank's shard of the layer at tensor-parallel size tp."""
    n, k = shape
    return (n, k // tp) if name in ROW_PARALLEL else (-(-n // tp), k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16", help="M values, comma separated")
    parser.add_argument("--model", default="llama-3.1-8b",
                        help="the preset whose shapes are measured (a mixture of experts: attention, router, lm_head)")
    parser.add_argument("--shapes", help="a subset of the model's layers (default: all; llama-3.1-8b's are "
                        + ",".join(SHAPES) + ")")
    parser.add_argument("--sweep", action="store_true", help="also sweep GEMV configs (M = 1 and 16)")
    parser.add_argument("--sweep-formats", default=",".join(SWEEP_FORMATS), help="subset of the formats to sweep")
    parser.add_argument("--sweep-rows", default=",".join(map(str, SWEEP_ROWS)), help="M values to sweep (1, 16)")
    parser.add_argument("--sweep-budget-s", type=float, default=170.0, help="shared fairly by (shape, M, format)")
    parser.add_argument("--no-measure", action="store_true", help="sweep only")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="one rank's shards at this TP size")
    parser.add_argument("--output", default=str(Path(os.environ.get("OUT", "./out")) / "gpu_gemv.json"))
    args = parser.parse_args()
    device = "cpu" if SMOKE else "cuda"
    model_layers, num_layers = model_shapes(args.model)
    names = args.shapes.split(",") if args.shapes else list(model_layers)
    if unknown := set(names) - set(model_layers):
        parser.error(f"{args.model} has no layer {', '.join(sorted(unknown))}; its layers: {', '.join(model_layers)}")
    shapes = SMOKE_SHAPES if SMOKE else {name: model_layers[name] for name in names}
    shapes = {name: rank_shape(name, shape, args.tensor_parallel) for name, shape in shapes.items()}
    group = SMOKE_GROUP if SMOKE else GROUP
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    began = time.monotonic()
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    layers, sweep = {}, {}
    if not args.no_measure:
        for name, (n, k) in shapes.items():
            layer = build_layer(n, k, group, device)
            layers[name] = {"N": n, "K": k, "rows": measure_layer(name, layer, rows, bandwidth, device)}
            release(layer)
    if args.sweep:
        combos = [(name, m, fmt) for name in shapes for m in map(int, args.sweep_rows.split(","))
                  for fmt in args.sweep_formats.split(",")]
        sweep_start = time.monotonic()
        for name, (n, k) in shapes.items():  # one layer built at a time; each combo gets its share of the budget
            layer = build_layer(n, k, group, device)
            for i, (_, m, fmt) in ((i, c) for i, c in enumerate(combos) if c[0] == name):
                deadline = sweep_start + args.sweep_budget_s * (i + 1) / len(combos)
                sweep[fmt, m, name] = sweep_shape(fmt, m, layer, device, deadline)
                print(f"sweep {fmt} M={m} {name}: {json.dumps(sweep[fmt, m, name]['best'])}", flush=True)
            release(layer)
    report = {"device": "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(), "torch": torch.__version__,
              "model": args.model,
              "tensor_parallel": args.tensor_parallel, "group_size": group, "peak_bytes_per_s": PEAK_BYTES_PER_S,
              "copy_bytes_per_s": bandwidth,
              "layers": layers, "decode_batch1": decode_bound(layers, num_layers) if layers else {},
              "int4_faster": int4_faster(layers),
              "sweep": {f"{fmt}/M={m}/{name}": r for (fmt, m, name), r in sweep.items()},
              "seconds": round(time.monotonic() - began, 1)}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2))
    print_table(layers)
    print("\ndecode batch 1, linears only:", json.dumps(report["decode_batch1"]))
    print("faster int4 kernel per M (set config.KernelOptions.int4_tinygemm_max_m):", json.dumps(report["int4_faster"]))
    if sweep:
        print("\nTUNED_CONFIGS entries (ops/triton_gemv.py):")
        print("\n".join(tuned_config_lines(sweep, shapes)))
    print(f"\nwrote {args.output} in {report['seconds']}s")


if __name__ == "__main__":
    main()
