"""`goodserve calc batch`: the fastest a batch of requests sent at once can finish on a GPU
(diagnose/batch_bound.py), for requests drawn as `goodserve bench` draws them (the same flags and seed)
or as the engine benchmarks' offline batch.
"""

from __future__ import annotations

import json

from rich.table import Table

from goodserve.bench.workloads import (LENGTH_DISTS, SYNTHETIC_DATASETS, WorkloadConfig, offline_sharegpt_lengths,
                                       synthetic_lengths)
from goodserve.console import make_console
from goodserve.diagnose.batch_bound import BatchBound, batch_bound
from goodserve.diagnose.calc import DTYPE_BYTES, FitReport, fit
from goodserve.diagnose.model_shape import resolve_spec
from goodserve.diagnose.roofline import default_compute_dtype
from goodserve.errors import InvalidRequestError
from goodserve.hardware import HARDWARE, get_hardware
from goodserve.model.spec import ModelSpec

BATCH_DATASETS = (*SYNTHETIC_DATASETS, "sharegpt-offline")
# Random's length flags: None unless given, so another dataset can refuse them (WorkloadConfig holds the defaults).
RANDOM_LENGTH_FLAGS = {"random_input_len": "--random-input-len", "random_output_len": "--random-output-len",
                       "random_range_ratio": "--random-range-ratio", "random_length_dist": "--random-length-dist"}


def register_batch(actions) -> None:
    batch = actions.add_parser(
        "batch", help="the fastest a batch of requests sent at once can finish on a GPU, and what bounds it",
        description="The floor time of a batch of requests submitted at once: max(bytes / bandwidth, FLOPs / "
                    "matmul rate), one token a step, so at least as many steps as the longest answer, each reading "
                    "the weights. It assumes perfect overlap of compute with memory traffic and perfect packing of "
                    "the other requests into the longest one's steps: a ceiling no engine reaches.")
    batch.add_argument("--model", required=True, help="preset, dummy:<preset>, .gguf or HF dir")
    batch.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="weight dtype")
    batch.add_argument("--kv-dtype", choices=sorted(DTYPE_BYTES), default="fp16", help="KV cache dtype")
    batch.add_argument("--gpu", default="h100-sxm", help=f"the card's datasheet: {', '.join(HARDWARE)}")
    batch.add_argument("--bandwidth-gbps", type=float,
                       help="memory bandwidth, GB/s, e.g. a measured copy rate (default: --gpu's datasheet peak, "
                            "which no kernel passes; a copy reaches ~90%% of it)")
    batch.add_argument("--tflops", type=float, help="matmul rate, TFLOP/s, e.g. a measured one (default: --gpu's "
                                                    "dense peak in the weights' compute dtype)")
    batch.add_argument("--json", action="store_true", help="print the bound as JSON")
    g = batch.add_argument_group("requests (bench's workload flags; the same seed draws the same lengths)")
    g.add_argument("--dataset-name", "--workload", choices=BATCH_DATASETS, default="random",
                   help="random: --random-* lengths (fixed unless --random-range-ratio); sharegpt: bench's "
                        "synthetic ShareGPT lengths; sharegpt-offline: the engine benchmarks' offline batch, "
                        "lognormal lengths with means 200 in / 180 out, each clipped to 4..1024")
    g.add_argument("--num-prompts", type=int, default=1000, help="requests in the batch")
    g.add_argument("--seed", type=int, default=0, help="the lengths' draws")
    g.add_argument("--random-input-len", "--prompt-len", type=int, help="random: prompt tokens (default: 1024)")
    g.add_argument("--random-output-len", "--output-len", type=int, help="random: output tokens (default: 128)")
    g.add_argument("--random-range-ratio", type=float, help="random: the lengths' spread (default: 0, fixed)")
    g.add_argument("--random-length-dist", choices=LENGTH_DISTS, help="random: how they spread (default: uniform)")
    g.add_argument("--sharegpt-output-len", type=int, help="sharegpt: every request's output tokens (default: "
                                                           "drawn)")
    batch.set_defaults(func=_batch)


def _batch(args) -> int:
    gpu = get_hardware(args.gpu)
    compute_dtype = default_compute_dtype(args.dtype)
    for flag, value in (("--bandwidth-gbps", args.bandwidth_gbps), ("--tflops", args.tflops)):
        if value is not None and value <= 0:
            raise InvalidRequestError(f"{flag} must be positive, got {value:g}")
    spec = resolve_spec(args.model)
    lengths = _batch_lengths(args, spec)
    bandwidth = args.bandwidth_gbps * 1e9 if args.bandwidth_gbps is not None else gpu.memory_bandwidth
    flops_rate = args.tflops * 1e12 if args.tflops is not None else gpu.flops_for(compute_dtype)
    bound = batch_bound(spec, lengths, bandwidth, flops_rate, args.dtype, args.kv_dtype)
    room = fit(spec, gpu.memory_bytes, dtype=args.dtype, kv_dtype=args.kv_dtype)
    if args.json:
        print(json.dumps({"model": spec.name, "gpu": gpu.name, "dtype": args.dtype, "kv_dtype": args.kv_dtype,
                          "dataset_name": args.dataset_name, "seed": args.seed, **bound.as_dict(),
                          "kv_room_bytes": room.kv_budget_per_gpu}, indent=2))
        return 0
    _print_batch(spec, bound, room, args, gpu.name, compute_dtype)
    return 0


def _batch_lengths(args, spec: ModelSpec) -> list[tuple[int, int]]:
    """(prompt, output) tokens of each request, as bench (or the engine benchmarks' offline batch) draws them."""
    given = {field: getattr(args, field) for field in RANDOM_LENGTH_FLAGS if getattr(args, field) is not None}
    if given and args.dataset_name != "random":
        raise InvalidRequestError(f"{', '.join(RANDOM_LENGTH_FLAGS[f] for f in given)} set --dataset-name random's "
                                  f"lengths, not {args.dataset_name}'s")
    if args.sharegpt_output_len is not None and args.dataset_name != "sharegpt":
        raise InvalidRequestError(f"--sharegpt-output-len sets --dataset-name sharegpt's answers, not "
                                  f"{args.dataset_name}'s")
    for flag, value in (("--num-prompts", args.num_prompts), ("--random-input-len", args.random_input_len),
                        ("--random-output-len", args.random_output_len),
                        ("--sharegpt-output-len", args.sharegpt_output_len)):
        if value is not None and value < 1:
            raise InvalidRequestError(f"{flag} must be at least 1, got {value}")
    if args.dataset_name == "sharegpt-offline":
        lengths = list(zip(*offline_sharegpt_lengths(args.num_prompts, args.seed)))
    else:
        lengths = synthetic_lengths(WorkloadConfig(dataset_name=args.dataset_name, num_prompts=args.num_prompts,
                                                   seed=args.seed, sharegpt_output_len=args.sharegpt_output_len,
                                                   **given))
    longest = max(p + o for p, o in lengths)
    if spec.max_position_embeddings and longest > spec.max_position_embeddings:
        raise InvalidRequestError(f"a request of {longest} tokens (prompt and output) passes {spec.name}'s context of "
                                  f"{spec.max_position_embeddings}")
    return lengths


def _print_batch(spec: ModelSpec, b: BatchBound, room: FitReport, args, gpu_name: str, compute_dtype: str) -> None:
    console = make_console()
    rates = (f"{b.bandwidth / 1e9:.0f} GB/s{'' if args.bandwidth_gbps is None else ' (given)'}, "
             f"{b.flops_rate / 1e12:.0f} TFLOP/s {compute_dtype}{'' if args.tflops is None else ' (given)'}")
    console.print(f"{spec.name}, {args.dtype} weights, {args.kv_dtype} KV, on {gpu_name}: {rates}")
    console.print(f"{b.requests} requests ({args.dataset_name}, seed {args.seed}): {b.prompt_tokens:,} prompt and "
                  f"{b.output_tokens:,} output tokens; the longest answer, {b.steps:,} tokens, takes {b.steps:,} "
                  f"steps")
    kv_token = f"{spec.kv_bytes_per_token(DTYPE_BYTES[args.kv_dtype]) / 1024:.4g} KiB"
    fed = b.prompt_tokens + b.output_tokens - b.requests
    table = Table(title="what the batch must move and compute")
    for column, justify in (("", "left"), ("count", "left"), ("total", "right"), ("time", "right")):
        table.add_column(column, justify=justify)
    bound_mark = {"bandwidth": ("  [bold]<- binds[/bold]", ""), "compute": ("", "  [bold]<- binds[/bold]")}[b.binds]
    rows = [
        ("weight reads", f"{b.steps:,} steps x {_si(b.weight_bytes_per_step, 'B')}"
         + (" (the routed experts, on average)" if spec.is_moe else ""), b.weight_bytes, b.bandwidth),
        ("KV reads", f"{b.kv_token_reads:,.0f} tokens x {kv_token}", b.kv_read_bytes, b.bandwidth),
        ("KV writes", f"{fed:,} tokens x {kv_token}", b.kv_write_bytes, b.bandwidth),
        (f"bytes{bound_mark[0]}", "", b.bytes, b.bandwidth),
        ("matmuls", f"{fed:,} tokens through the layers, {b.output_tokens:,} through the lm_head",
         b.matmul_flops, b.flops_rate),
        ("attention", "QK^T and PV over each token's context", b.attention_flops, b.flops_rate),
        (f"FLOPs{bound_mark[1]}", "", b.flops, b.flops_rate),
    ]
    for name, count, total, rate in rows:
        table.add_row(name, count, _si(total, "B" if rate == b.bandwidth else "FLOP"), _duration(total / rate))
    console.print(table)
    console.print(f"floor: [bold]{_duration(b.seconds)}[/bold], {b.binds}-bound: at most [bold]{b.requests_per_s:.1f} "
                  f"req/s[/bold], {b.output_tokens_per_s:,.0f} output tok/s")
    _print_memory(console, b, room)
    console.print("It assumes compute and memory traffic overlap perfectly and every other request packs into the "
                  "longest one's steps, with the whole batch's KV held at once: a ceiling no engine reaches.")


def _print_memory(console, b: BatchBound, room: FitReport) -> None:
    """Whether the packing the floor assumes fits: every request's KV at once, beside the weights."""
    if not room.weights_fit:
        console.print(f"memory: the weights, {_si(room.weight_bytes_per_gpu, 'B')}, do not fit one GPU of "
                      f"{_si(room.gpu_memory_bytes, 'B')}: calc fit finds a layout; this floor is one GPU's")
        return
    where = f"{_si(room.kv_budget_per_gpu, 'B')} left beside the weights (0.9 of {_si(room.gpu_memory_bytes, 'B')})"
    if b.kv_held_bytes <= room.kv_budget_per_gpu:
        console.print(f"memory: the whole batch's KV at its longest, {_si(b.kv_held_bytes, 'B')}, fits the {where}")
        return
    console.print(f"memory: the whole batch's KV at its longest, {_si(b.kv_held_bytes, 'B')}, passes the {where}: "
                  f"an engine must hold requests back, so the batch takes longer than this floor")


def _duration(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{1000 * seconds:.3g} ms"


def _si(value: float, unit: str) -> str:
    """15.01 GB, 2.733 PFLOP: four significant digits at the nearest power of 1000."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.4g} {prefix}{unit}"
    return f"{value:.4g} {unit}"
