"""INT4 batch-1 decode on the GPU (the target: dummy llama-3.1-8b at >= 400 tok/s): the one-row int4
kernels at Llama-3.1-8B shapes, then the engine's decode with each routing, in one call.

Parts (--parts, default kernels,e2e,peer; in this order, one process):
  kernels  device-to-device copy bandwidth; then per shape (qkv, o, gate_up, down, lm_head), M = 1:
             tinygemm       torch's _weight_int4pack_mm on quant/linear.tinygemm_layout (the default)
             triton         the GEMV family's int4 path (int4_matmul, TUNED_CONFIGS)
             rows           ops/triton_gemv.int4_rows_gemv on the checkpoint layout
             rows_repacked  the same on int4_rows_layout's copy (bf16 scale / zero pairs)
           each rows kernel over the decodes (rows_configs) x (block_n, num_warps) x split_k
           (--kernel-budget-s); M = 4: tinygemm and triton (the rows kernel takes one row). lm_head
           also as bf16 (cuBLAS) and int8 (Triton GEMV), what the engine runs there. Timing, weight
           copies (>= 256 MB, so every call streams from HBM) and errors come from gpu_gemv.py's
           harness: CUDA graphs of back-to-back calls, median replay; rel_error = |y - x W^T| / |x W^T|
           in float32 against the dequantized codes (float32 scales: the repacked layout's bfloat16
           rounding counts as error, as tinygemm's does).
           floor = (codes + 4 bytes of scale and zero a group) / 3.0 TB/s, the same for every int4
           path (of_copy: against the copy bandwidth measured here). Picks each shape's fastest
           kernel and prints the quant/linear.py and ops/triton_gemv.py entries that route to it.
  e2e      goodserve's LLM API, dummy:llama-3.1-8b, batch 1, 128-token prompt, 256 greedy tokens
           (gpu_engine.part_decode, best of 3), int4 layers with a quantized lm_head (e2e_runs):
             int4_lm_head_int4_and_attention   an int4 lm_head on rows_repacked and decode attention's
                                          levers (RoPE + KV write fused in, one split by the
                                          --decode-tuning table): 370.5 tok/s on an H100
                                          (results/gpu_int4_levers_alone_h100.json)
             int4_lm_head_int4_attention_fused_silu   the same with SwiGLU in gate_up's kernel
                                          (KernelOptions.int4_fused_silu_and_mul, off by default)
             int4_best_lm_head_int8       the earlier best (337.5 tok/s): gate_up on rows_repacked
                                          (or the kernels part's winners, if it ran), int8 lm_head
             bf16                         the reference (left out when the budget runs out)
           Kernel configs: INT4_ROWS_TUNED (the H100 winners), or the kernels part's.
  peer     Hugging Face transformers generate() (eager), bf16, batch 1, 256 tokens (gpu_engine.part_peer).
--budget-s: e2e / peer runs that would start after it are skipped (and listed as skipped).

Prediction before the first run (written on the CPU; the H100 numbers it starts from are
results/gpu_gemv_h100.json and gpu_engine_h100_v6.json). Two floors for gate_up at M = 1: bytes
(58.7 MB of codes + 3.7 MB of bf16 scale / zero) / 3.0 TB/s = 20.9 us; instructions, from the sm_90
SASS of Triton 3.9's AOT build on this machine: the family's tuned one-row int4 config issues 4.57
instructions a code in its loop (21 shuffles, 2 barriers a step), 117.4 M codes -> 16.8 M warp
instructions / (132 SMs x 4 / clock x 1.755 GHz) = 18 us at full issue. It runs 35.4 us: neither
floor is met, both are close to each other, so int4 here is bound by memory and issue together.
The rows kernel's loop issues 4.89 instructions a code at 2 rows a thread (6.03 at 1): per code a
shift, a mask-or and an FMA, plus x's bf16 -> fp32 conversion and the group's x sum per thread, and
a constant the mask-or needs rematerialized; 5 shuffles and 2 barriers a group (a layout change of
the group's sum). So no gain in instructions; the repacked layout reads 4 instead of 8 bytes of
scale / zero a group (-5% bytes) in 512-byte warp loads. Expected: within +-10% of the family and
tinygemm per layer with the family's decode. The subnormal decode (Int4RowsConfig.denormal: the
nibble masked in place into an fp32 with exponent 0, x scaled per position once a chunk) issues
3.93 instructions a code at 2 rows a thread (no rematerialized constant, no shift for 5 of 8
codes): 14% fewer than the family, 20% fewer than the mantissa decode, so gate_up ~35 -> ~30 us
if issue is half the limit, and ~0.25 ms a token over 32 layers: int4 decode 334 -> ~360 tok/s with
the int8 lm_head, not 400. Past that, packed bf16x2 decoding and FMAs through inline PTX (~1.2
instructions a code; the interpreter cannot run it) or a tensor-core path like tinygemm's.
Prediction for the e2e runs (written on the CPU from the earlier H100 numbers, 337.5 tok/s =
2963 us a token): an int4 lm_head takes 112 us where int8 took 185 (-73 us: ~346 tok/s); the fused
SwiGLU drops the activation kernel (1.5 us a layer in the bf16 profile, plus its launch) and gate_up
writes half the outputs, the same 4 us of work a layer more in its epilogue: -50 to -65 us (~343).
400 needs ~460 us less a token than 337.5. (A third lever, x prescaled once per block in the rows
kernel, was measured slower and removed: benchmarks/BENCHMARKS.md.)
--smoke: CPU, TRITON_INTERPRET=1, tiny shapes, the smollm2-135m preset for 4 tokens: catches Python errors.

    PYTHONPATH=src python3 benchmarks/gpu_int4.py          # writes $OUT/gpu_int4.json (OUT: ./out)
    PYTHONPATH=src python3 benchmarks/gpu_int4.py --parts e2e --budget-s 230   # the levers alone, < 4 min
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, so before importing them

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gpu_gemv  # noqa: E402  (benchmarks/: the timing harness)
from goodserve.config import KernelOptions  # noqa: E402
from goodserve.ops import triton_gemv  # noqa: E402
from goodserve.ops.triton_gemv import Int4RowsConfig, int4_rows_gemv, int4_rows_layout  # noqa: E402
from goodserve.quant import linear, schemes  # noqa: E402
from goodserve.quant.triton_kernels import int4_matmul, int8_matmul  # noqa: E402

SHAPES = gpu_gemv.SMOKE_SHAPES if SMOKE else gpu_gemv.SHAPES
GROUP = gpu_gemv.SMOKE_GROUP if SMOKE else gpu_gemv.GROUP
# rows kernel tiles (block_n, num_warps): 1 and 2 rows a thread (4 spill: 255 registers, a 128-byte
# stack frame in the sm_90 build, and so do (64, 1)'s 2 rows at 189 registers)
ROWS_TILES = [(16, 1), (8, 1)] if SMOKE else [(64, 2), (128, 4), (128, 2), (256, 4)]
ONE_ROW_PATHS = ("tinygemm", "triton", "rows", "rows_repacked")
E2E_MODEL = "dummy:smollm2-135m" if SMOKE else "dummy:llama-3.1-8b"
E2E_SECONDS = 45  # a guess at one engine run (load, quantize, graphs, 3 x 256 tokens), for the budget


# ---------------------------------------------------------------------------------------------
# Kernels


def floor_us(n: int, k: int, group: int) -> float:
    return (n * k // 2 + 4 * n * (k // group)) / gpu_gemv.PEAK_BYTES_PER_S * 1e6


def timed(calls: list[Callable[[], torch.Tensor]], ref: torch.Tensor, floor: float, bandwidth: float) -> dict:
    """gpu_gemv's graph timing of the calls cycled, with the first call's error against ref."""
    try:
        out = calls[0]()
        error = gpu_gemv.relative_error(out, ref) if torch.isfinite(out).all() else math.inf
        for call in calls[1:]:
            call()
        us = gpu_gemv.graph_time_us(calls)
    except Exception as exc:  # noqa: BLE001 - a failing variant is recorded, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    copy_floor = floor * gpu_gemv.PEAK_BYTES_PER_S / bandwidth
    return {"us": round(us, 2), "of_floor": round(floor / us, 3), "of_copy": round(copy_floor / us, 3),
            "rel_error": round(error, 5), "ok": error < gpu_gemv.OK_REL_ERROR}


def rows_configs(n: int, k: int, device: torch.device) -> list[Int4RowsConfig]:
    """The decodes (fewest instructions a code in the SASS first: subnormal, mantissa) x ROWS_TILES,
    each with the split rule's split_k, half and twice it (and none where the rule asks for at most 2)."""
    configs = []
    for denormal in (True, False):
        for block_n, num_warps in ROWS_TILES:
            rule = triton_gemv.int4_rows_config(n, k, GROUP, device, block_n=block_n, num_warps=num_warps).split_k
            for split_k in sorted({1 if rule <= 2 else rule, rule, max(1, rule // 2), min(k // GROUP, 2 * rule)}):
                configs.append(Int4RowsConfig(block_n, num_warps, split_k, denormal))
    return configs


@torch.no_grad()
def measure_shape(name: str, n: int, k: int, bandwidth: float, device: str, deadline: float) -> dict:
    w = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)
    q = schemes.quantize_int4(w, GROUP)
    deq = schemes.dequantize_int4(q)
    copies = gpu_gemv._replicate((q.qweight, q.scales, q.zeros), n * k // 2)
    floor = floor_us(n, k, GROUP)
    result = {"N": n, "K": k, "floor_us": round(floor, 2), "M1": {}, "M4": {}}
    try:
        tiny = [linear.tinygemm_layout(*c, GROUP) for c in copies]
    except Exception as exc:  # noqa: BLE001 - CPU (smoke), or a torch without the op: recorded
        tiny, result["tinygemm_error"] = None, f"{type(exc).__name__}: {exc}"[:200]
    for m in (1, 4):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        ref = x.float() @ deq.T
        row = result[f"M{m}"]
        if tiny is not None:
            row["tinygemm"] = timed([lambda t=t: torch.ops.aten._weight_int4pack_mm(x, t[0], GROUP, t[1])
                                     for t in tiny], ref, floor, bandwidth)
        row["triton"] = timed([lambda c=c: int4_matmul(x, *c, GROUP, gpu_gemv.PDL) for c in copies], ref, floor,
                              bandwidth)
        if m > 1:
            continue
        row["rows"], row["rows_repacked"] = [], []
        repacked: dict[int, list] = {}
        for config in rows_configs(n, k, x.device):
            if time.monotonic() > deadline:
                row["rows_sweep_cut"] = True
                break
            fields = {"num_warps": config.num_warps, "split_k": config.split_k, "denormal": config.denormal,
                      "pdl": gpu_gemv.PDL}
            entry = timed([lambda c=c: int4_rows_gemv(x, *c, GROUP, block_n=config.block_n, **fields)
                           for c in copies], ref, floor, bandwidth)
            row["rows"].append({**config.__dict__, **entry})
            if config.block_n not in repacked:
                repacked[config.block_n] = [int4_rows_layout(*c, GROUP, config.block_n) for c in copies]
            entry = timed([lambda r=r: int4_rows_gemv(x, r, **fields) for r in repacked[config.block_n]],
                          ref, floor, bandwidth)
            row["rows_repacked"].append({**config.__dict__, **entry})
        del repacked
    if name == "lm_head":  # the engine's other formats there: bf16 (default) or int8 (quantize_lm_head)
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        q8 = schemes.quantize_int8(w)
        result["lm_head_bf16"] = timed([lambda: F.linear(x, w)], x.float() @ w.float().T, 2 * n * k / 3e6, bandwidth)
        result["lm_head_int8"] = timed([lambda: int8_matmul(x, q8.qweight, q8.scales, gpu_gemv.PDL)],
                                       x.float() @ schemes.dequantize_int8(q8).T, (n * k + 4 * n) / 3e6, bandwidth)
    return result


def best_of(entries: list[dict]) -> dict | None:
    good = [e for e in entries if e.get("ok")]
    return min(good, key=lambda e: e["us"]) if good else None


def winners(kernels: dict) -> dict:
    """Per shape at M = 1: each path's fastest correct entry, and the fastest path."""
    picks = {}
    for name, shape in kernels.items():
        row = shape.get("M1", {})
        paths = {p: best_of(_entries(row.get(p))) for p in ONE_ROW_PATHS}
        paths = {p: e for p, e in paths.items() if e is not None}
        fastest = min(paths, key=lambda p: paths[p]["us"]) if paths else None
        picks[name] = {"paths": paths, "fastest": fastest}
    return picks


def rows_config(entry: dict) -> Int4RowsConfig:
    """A sweep entry's Int4RowsConfig: its fields only (an older JSON's "prescaled", a removed variant,
    and the timings are not fields)."""
    return Int4RowsConfig(**{f.name: entry[f.name] for f in dataclasses.fields(Int4RowsConfig) if f.name in entry})


def routing_entries(picks: dict) -> tuple[dict, dict]:
    """(KernelOptions.int4_one_row_kernel_by_shape, INT4_ROWS_TUNED / KernelOptions.int4_rows_configs)
    for the layers' shapes (not lm_head: the e2e runs put an int4 one on rows_repacked)."""
    by_shape, tuned = {}, {}
    for name, pick in picks.items():
        if name == "lm_head" or pick["fastest"] is None:
            continue
        n, k = SHAPES[name]
        by_shape[n, k] = pick["fastest"]
        if pick["fastest"].startswith("rows"):
            e = pick["paths"][pick["fastest"]]
            tuned[n, k] = rows_config(e)
    return by_shape, tuned


def decode_bound(kernels: dict, picks: dict) -> dict:
    """Linears-only batch-1 step: 32 x the four layers + lm_head, per routing and lm_head format."""
    def layers_us(choose: Callable[[str], str | None]) -> float | None:
        times = [picks[name]["paths"].get(choose(name) or "", {}).get("us") for name in picks if name != "lm_head"]
        return None if None in times or len(times) < 4 else gpu_gemv.NUM_LAYERS * sum(times)

    head = kernels.get("lm_head", {})
    heads = {"bf16": head.get("lm_head_bf16", {}).get("us"), "int8": head.get("lm_head_int8", {}).get("us"),
             "int4": (picks.get("lm_head", {}).get("paths", {}).get(picks.get("lm_head", {}).get("fastest") or "")
                      or {}).get("us")}
    bound = {}
    for routing, choose in {"tinygemm": lambda name: "tinygemm",
                            "fastest": lambda name: picks[name]["fastest"]}.items():
        layers = layers_us(choose)
        for head_format, head_us in heads.items():
            if layers is not None and head_us is not None:
                step = layers + head_us
                bound[f"{routing}/lm_head_{head_format}"] = {"linear_us": round(step, 1),
                                                            "tok_s_bound": round(1e6 / step, 1)}
    return bound


def part_kernels(bandwidth: float, device: str, budget_s: float) -> dict:
    kernels = {}
    start = time.monotonic()
    for i, (name, (n, k)) in enumerate(SHAPES.items()):
        try:
            share = (i + 2) / (len(SHAPES) + 1)  # the first shape's share twice: it pays the compiles
            kernels[name] = measure_shape(name, n, k, bandwidth, device, start + budget_s * share)
        except Exception as exc:  # noqa: BLE001 - keep the other shapes (out of memory, say)
            kernels[name] = {"N": n, "K": k, "error": f"{type(exc).__name__}: {exc}"[:300]}
        if not SMOKE:
            torch.cuda.empty_cache()
        print(f"kernels {name} done ({time.monotonic() - start:.0f}s)", flush=True)
    return kernels


# ---------------------------------------------------------------------------------------------
# Engine


def e2e_runs(by_shape: dict, tuned: dict, decode_table: dict) -> list[tuple[str, str | None, KernelOptions | None]]:
    """(name, lm_head method, kernel options) of each engine run: the best so far first, then the
    fused SwiGLU (off by default) added to it, the earlier best, bf16 (the reference) last.
    Layers take the kernels part's winners where it ran, else gate_up on rows_repacked (the best
    measured routing, results/gpu_int4_h100.json), with INT4_ROWS_TUNED's configs; an int4 lm_head
    takes rows_repacked (112 us there against tinygemm's 135), and the fused SwiGLU needs gate_up on it."""
    gate_up, head = SHAPES["gate_up_proj"], SHAPES["lm_head"]
    layers = by_shape or {gate_up: "rows_repacked"}
    rows = {**layers, gate_up: "rows_repacked"}
    configs = {**triton_gemv.INT4_ROWS_TUNED, **tuned}

    def options(routing: dict, fused: bool = False, attention: bool = False) -> KernelOptions:
        chosen = {shape: dataclasses.asdict(configs[shape])
                  for shape, kernel in routing.items() if kernel.startswith("rows") and shape in configs}
        return KernelOptions(int4_one_row_kernel_by_shape=routing, int4_rows_configs=chosen,
                             int4_fused_silu_and_mul=fused, fuse_rotary_into_decode_attention=attention,
                             decode_attention_tuning_by_batch=decode_table if attention else {})

    head4 = {**layers, head: "rows_repacked"}
    every = {**rows, head: "rows_repacked"}
    return [  # the comparison that matters first: a run the budget leaves out is the least needed
        ("int4_lm_head_int4_and_attention", "int4", options(head4, attention=True)),  # 370.5 tok/s on an H100
        ("int4_lm_head_int4_attention_fused_silu", "int4", options(every, fused=True, attention=True)),
        ("int4_best_lm_head_int8", "int8", options(layers)),  # 337.5 tok/s on an H100
        ("bf16", None, None),
    ]


def part_e2e(bandwidth: float, by_shape: dict, tuned: dict, deadline: float,
             decode_tuning: str | None) -> tuple[dict, list[str]]:
    import gpu_engine  # imports goodserve.LLM: here, so that a failing import leaves the kernels' numbers

    decode_table = gpu_engine.load_decode_table(decode_tuning) if decode_tuning else gpu_engine.DECODE_TABLE_GUESS
    order = e2e_runs(by_shape, tuned, decode_table)
    if SMOKE:  # CPU: two runs exercise the code (an int4 lm_head and the options' wiring)
        order = order[:2]
    results, skipped = {}, []
    device = "cpu" if SMOKE else "cuda"
    for name, head, kernels in order:
        if time.monotonic() + E2E_SECONDS > deadline:
            skipped.append(name)
            continue
        started = time.monotonic()
        try:
            gpu_engine.results.clear()
            gpu_engine.part_decode(bandwidth / 1e9, E2E_MODEL, None if head is None else "int4",
                                   quantize_lm_head=head is not None, lm_head_quantization=head or "int8",
                                   device=device, new_tokens=4 if SMOKE else 256, kernels=kernels or KernelOptions())
            (result,) = gpu_engine.results.values()
            if kernels is not None:
                result["routing"] = {f"{n}x{k}": kernel for (n, k), kernel in
                                     kernels.int4_one_row_kernel_by_shape.items()} or "default"
                result["rows_configs"] = {f"{n}x{k}": config for (n, k), config in kernels.int4_rows_configs.items()}
                result["fused_silu_and_mul"] = kernels.int4_fused_silu_and_mul
                result["fused_rotary_decode_attention"] = kernels.fuse_rotary_into_decode_attention
                result["decode_attention_tuning_by_batch"] = kernels.decode_attention_tuning_by_batch
            results[name] = result
        except Exception as exc:  # noqa: BLE001 - keep the other runs' numbers
            import traceback

            traceback.print_exc()
            results[name] = {"error": repr(exc)[:500]}
        results[name]["seconds"] = round(time.monotonic() - started, 1)
        print(f"e2e {name}: {_tok_s(results[name])} tok/s ({results[name]['seconds']}s)", flush=True)
    return results, skipped


def _tok_s(result: dict) -> float | None:
    runs = result.get("runs")
    return round(max(r["decode_tok_s"] for r in runs), 1) if runs else None


def part_peer(deadline: float) -> tuple[dict, list[str]]:
    if SMOKE or time.monotonic() + 2 * E2E_SECONDS > deadline:
        return {}, ["peer" + (" (smoke: no GPU)" if SMOKE else "")]
    import gpu_engine

    gpu_engine.results.clear()
    try:
        gpu_engine.part_peer(E2E_MODEL, continuous_batching=False)
    except Exception as exc:  # noqa: BLE001
        gpu_engine.results["peer"] = {"error": repr(exc)[:500]}
    return gpu_engine.results["peer"], []


# ---------------------------------------------------------------------------------------------


def cell(entry: dict | None) -> str:
    if not entry or "us" not in entry:
        return "-"
    flag = "" if entry["ok"] else f" BAD {entry['rel_error']:.2g}"
    return f"{entry['us']:.1f} ({100 * entry['of_floor']:.0f}%){flag}"


def _entries(value: dict | list | None) -> list[dict]:
    return value if isinstance(value, list) else [value] if value else []


def print_tables(report: dict) -> None:
    picks = report.get("winners", {})
    if picks:
        print(f"\n{'M=1 us (of floor)':<14}{'floor':>7}" + "".join(f"{p:>22}" for p in ONE_ROW_PATHS) + "   fastest")
        for name, pick in picks.items():
            shape = report["kernels"][name]
            print(f"{name:<14}{shape.get('floor_us', math.nan):>7.1f}" + "".join(f"{cell(pick['paths'].get(p)):>22}"
                                                                  for p in ONE_ROW_PATHS) + f"   {pick['fastest']}")
        for name, shape in report["kernels"].items():
            m4 = shape.get("M4", {})
            print(f"{name} M=4: tinygemm {cell(m4.get('tinygemm'))}, triton {cell(m4.get('triton'))}")
            failures = [e["error"] for p in ONE_ROW_PATHS for e in _entries(shape.get("M1", {}).get(p)) if "error" in e]
            if "error" in shape or failures:
                print(f"  {name} errors: {shape.get('error', '')} {len(failures)} failed, first: {failures[:1]}")
        head = report["kernels"].get("lm_head", {})
        print(f"lm_head bf16 {cell(head.get('lm_head_bf16'))}, int8 {cell(head.get('lm_head_int8'))}")
        print("linears-only decode bound:", json.dumps(report["decode_bound"]))
        by_shape, tuned = report["routing_entries"]
        print("\nconfig.py: KernelOptions.int4_one_row_kernel_by_shape = {" + ", ".join(
            f'({s}): "{kernel}"' for s, kernel in by_shape.items()) + "}")
        print("ops/triton_gemv.py: INT4_ROWS_TUNED = {" + ", ".join(
            f"({s}): Int4RowsConfig({c})" for s, c in tuned.items()) + "}")
    e2e = report.get("e2e", {})
    if e2e:
        print(f"\n{'e2e batch-1 decode':<40}{'tok/s':>8}{'MBU':>7}  lm_head  fused  routing")
        for name, result in e2e.items():
            mbu = f"{100 * result['mbu']:.0f}%" if "mbu" in result else "-"
            print(f"{name:<40}{_tok_s(result) or result.get('error', '-')!s:>8}{mbu:>7}  "
                  f"{result.get('lm_head_quantization')!s:<7}  {result.get('fused_silu_and_mul', '-')!s:<5}  "
                  f"{result.get('routing', '')}")
    peer = report.get("peer", {})
    if peer:
        print(f"HF transformers generate bf16: {peer.get('hf_generate_batch1_tok_s', peer)} tok/s")
    if report["skipped"]:
        print("skipped (budget):", ", ".join(report["skipped"]))
    print(f"\nwrote {report['output']} in {report['seconds']}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="kernels,e2e,peer")
    parser.add_argument("--kernel-budget-s", type=float, default=100.0, help="shared by the shapes' rows sweeps")
    parser.add_argument("--budget-s", type=float, default=330.0, help="no e2e / peer run starts past it")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    parser.add_argument("--output", default=str(Path(os.environ.get("OUT", "./out")) / "gpu_int4.json"))
    parser.add_argument("--decode-tuning", metavar="JSON", help="the attention runs' decode launch table (default: "
                        "gpu_engine.DECODE_TABLE_GUESS): gpu_kernels.py --decode-latency-sweep's decode_tuning_by_batch.json")
    args = parser.parse_args()
    parts = args.parts.split(",")
    began = time.monotonic()
    deadline = began + args.budget_s
    device = "cpu" if SMOKE else "cuda"
    torch.manual_seed(0)
    bandwidth = gpu_gemv.copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    report: dict = {"device": "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(), "torch": torch.__version__,
                    "group_size": GROUP, "copy_bytes_per_s": bandwidth, "skipped": [], "output": args.output}
    by_shape, tuned = {}, {}
    if "kernels" in parts:
        report["kernels"] = part_kernels(bandwidth, device, args.kernel_budget_s)
        report["winners"] = picks = winners(report["kernels"])
        report["decode_bound"] = decode_bound(report["kernels"], picks)
        by_shape, tuned = routing_entries(picks)
        report["routing_entries"] = ({f"{n}, {k}": v for (n, k), v in by_shape.items()},
                                     {f"{n}, {k}": f"block_n={c.block_n}, num_warps={c.num_warps}, split_k={c.split_k}, "
                                                   f"denormal={c.denormal}"
                                      for (n, k), c in tuned.items()})
    try:  # goodserve.LLM's imports (gguf, via model/loader.py) must not cost the kernels' numbers
        if "e2e" in parts:
            report["e2e"], skipped = part_e2e(bandwidth, by_shape, tuned, deadline, args.decode_tuning)
            report["skipped"] += skipped
        if "peer" in parts:
            report["peer"], skipped = part_peer(deadline)
            report["skipped"] += skipped
    except ImportError as exc:
        report["e2e_error"] = repr(exc)
        print("engine runs not possible:", repr(exc), flush=True)
    report["seconds"] = round(time.monotonic() - began, 1)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2, default=str))
    print_tables(report)


if __name__ == "__main__":
    main()
