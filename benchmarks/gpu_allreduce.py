"""All-reduce latency at decode's sizes: NCCL against the custom one-shot all-reduce on
symmetric memory (model/custom_all_reduce.py, what tensor parallelism uses for small tensors), each
eager and inside a CUDA graph (GRAPH_CALLS all-reduces back to back, one replay divided by them, as
the engine's decode graphs run them), bfloat16, one process a GPU. It also checks that the custom
path's sums equal NCCL's, eager and replayed, with the kernel's own input copy and with the staged
copy (an input not 16-byte aligned), and exits non-zero where one does not: the GPU check of the
custom all-reduce, which the one-GPU regression gate cannot run.

Then, per rows x hidden of --fused-shapes, the all-reduce fused with the residual add and RMSNorm
(ops/all_reduce_norm.py, what a decoder layer's norms run) against the one-shot all-reduce followed
by the Triton add + RMSNorm kernel it replaces, in CUDA graphs of GRAPH_CALLS calls: µs a call and
whether the outputs are the same (bit for bit at 2 GPUs, eager and replayed, the replayed graph
alternating two inputs so a call that read a stale row would show).

NCCL's NVLink multicast and symmetric memory's stay off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, set here before either starts; the ranks inherit them).

  python benchmarks/gpu_allreduce.py [--gpus 2] [--sizes-kb 8,16,64,256,1024] [--fused-shapes 1x4096,...]
      (on an nvidia-h100-x2)

Writes $OUT/gpu_allreduce.json and prints a table.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before any NCCL communicator exists (the ranks inherit it)
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")  # lets CUDA graphs capture NCCL (engine/worker/distributed.py)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from goodserve.model.custom_all_reduce import set_up_custom_all_reduce  # noqa: E402
from goodserve.ops.triton_ops import triton_add_rms_norm  # noqa: E402
from goodserve.ports import free_port  # noqa: E402
from result_file import write_result  # noqa: E402

GRAPH_CALLS = 64
EAGER_CALLS = 200
GRAPH_REPLAYS = 20


def elapsed_us(run, calls: int) -> float:
    """Mean time of one of `calls` calls (run makes them all), the ranks started together."""
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def eager_us(all_reduce) -> float:
    for _ in range(10):
        all_reduce()

    def run():
        for _ in range(EAGER_CALLS):
            all_reduce()
    return elapsed_us(run, EAGER_CALLS)


def capture(all_reduce) -> tuple[torch.cuda.CUDAGraph, list]:
    """A graph of GRAPH_CALLS all-reduces, all_reduce(i) the i-th (warmed up on a side stream first,
    as capture needs), and what the calls returned (their outputs live in the graph's pool)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            all_reduce(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [all_reduce(i) for i in range(GRAPH_CALLS)]
    return graph, outs


def graph_us(graph: torch.cuda.CUDAGraph) -> float:
    graph.replay()

    def run():
        for _ in range(GRAPH_REPLAYS):
            graph.replay()
    return elapsed_us(run, GRAPH_REPLAYS * GRAPH_CALLS)


def sums_equal(got: torch.Tensor, expected: torch.Tensor, world: int) -> bool:
    """Two ranks: a + b is the same whoever adds. More: the order of the additions, and whether the
    partial sums are rounded to bfloat16 between them, differ (NCCL's ring, torch's one-shot kernel,
    the fused kernel's float32 sum), so each of the world - 1 additions may round differently, by at
    most half a bfloat16 step (2^-8) of the largest sum; a missing or doubled rank is off by a whole
    value. (An element-wise 2% tolerance failed at 4 GPUs on 64 KB and more,
    results/gpu_allreduce_fused_h100x4.json: among tens of thousands of elements, small ones rounded
    differently can be off by more than 2% of themselves.)"""
    if world == 2:
        return torch.equal(got, expected)
    error = (got.float() - expected.float()).abs().max()
    return bool(error <= world * 2 ** -8 * expected.float().abs().max())


def measure(nbytes: int, custom, rank: int, world: int, device: torch.device) -> dict:
    numel = nbytes // 2
    generator = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(numel, generator=generator, device=device).to(torch.bfloat16)
    expected = x.clone()
    dist.all_reduce(expected)
    unaligned = torch.cat([x.new_zeros(2), x])[2:]  # 4 bytes past a 16-byte boundary: the staged copy
    # The graph's calls alternate two inputs through the one buffer: a call that read a peer's
    # buffer before (or after) that peer's call wrote it would show in its sum.
    inputs, sums = (x, x.flip(0)), (expected, expected.flip(0))
    graph, outs = capture(lambda i: custom(inputs[i % 2]))
    graph.replay()
    torch.cuda.synchronize()
    checks = {"custom_eager_equals_nccl": sums_equal(custom(x), expected, world),
              "custom_staged_copy_equals_nccl": sums_equal(custom(unaligned), expected, world),
              "custom_graph_equals_nccl": all(sums_equal(out, sums[i % 2], world) for i, out in enumerate(outs))}
    zeros = torch.zeros(numel, dtype=torch.bfloat16, device=device)  # summed in place forever: stays finite
    nccl_graph, _ = capture(lambda i: dist.all_reduce(zeros))
    return {"bytes": nbytes, "nccl_eager_us": eager_us(lambda: dist.all_reduce(zeros)),
            "nccl_graph_us": graph_us(nccl_graph), "custom_eager_us": eager_us(lambda: custom(x)),
            "custom_graph_us": graph_us(graph), **checks}


def measure_fused(rows: int, hidden: int, custom, rank: int, world: int, device: torch.device) -> dict:
    generator = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(rows, hidden, generator=generator, device=device).to(torch.bfloat16)
    common = torch.Generator(device=device).manual_seed(1000)  # residual and weight: alike on every rank
    residual = torch.randn(rows, hidden, generator=common, device=device).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(hidden, generator=common, device=device)).to(torch.bfloat16)

    def fused(i: int):
        return custom.add_rms_norm(inputs[i % 2], residual, weight, 1e-5)

    def unfused(i: int):
        return triton_add_rms_norm(custom(inputs[i % 2]), residual, weight, 1e-5)

    def same(got, expected) -> bool:
        return all(sums_equal(g, e, world) for g, e in zip(got, expected))

    inputs = (x, x.flip(0).flip(1).contiguous())
    expected = [unfused(i) for i in range(2)]
    checks = {"fused_eager_equals_unfused": all(same(fused(i), expected[i]) for i in range(2))}
    fused_graph, fused_outs = capture(fused)
    unfused_graph, _ = capture(unfused)
    for _ in range(3):
        fused_graph.replay()
    torch.cuda.synchronize()
    checks["fused_graph_equals_unfused"] = all(same(out, expected[i % 2]) for i, out in enumerate(fused_outs))
    return {"rows": rows, "hidden": hidden, "unfused_graph_us": graph_us(unfused_graph),
            "fused_graph_us": graph_us(fused_graph), **checks}


def rank_main(rank: int, world: int, port: int, sizes: list[int], fused_shapes: list[tuple[int, int]]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method="env://", device_id=device)
    try:
        custom = set_up_custom_all_reduce(None, device, max(sizes))
        if custom is None:
            raise SystemExit("the custom all-reduce could not be set up (the log says why)")
        rows = [measure(nbytes, custom, rank, world, device) for nbytes in sizes]
        fused = [measure_fused(r, h, custom, rank, world, device) for r, h in fused_shapes if custom.fuses(
            torch.empty(r, h, dtype=torch.bfloat16, device=device))]
        if rank == 0:
            report(rows, fused, world)
    finally:
        dist.destroy_process_group()


def report(rows: list[dict], fused: list[dict], world: int) -> None:
    all_equal = all(value for row in rows + fused for key, value in row.items() if "_equals_" in key)
    result = {"device": torch.cuda.get_device_name(), "gpus": world, "torch": torch.__version__,
              "dtype": "bfloat16", "graph_calls": GRAPH_CALLS, "nccl_nvls_enable": os.environ["NCCL_NVLS_ENABLE"],
              "all_equal": all_equal, "sizes": rows, "fused_add_rms_norm": fused}
    path = write_result("gpu_allreduce.json", result)
    print(f"{'KB':>6} {'nccl eager':>10} {'nccl graph':>10} {'custom eager':>12} {'custom graph':>12}  (us)  equal")
    for row in rows:
        equal = all(value for key, value in row.items() if key.endswith("_equals_nccl"))
        print(f"{row['bytes'] >> 10:>6} {row['nccl_eager_us']:>10.1f} {row['nccl_graph_us']:>10.1f} "
              f"{row['custom_eager_us']:>12.1f} {row['custom_graph_us']:>12.1f}        {equal}")
    print(f"{'rows x hidden':>14} {'all-reduce + add_rms_norm':>26} {'fused':>8}  (us, graphs)  equal")
    for row in fused:
        equal = row["fused_eager_equals_unfused"] and row["fused_graph_equals_unfused"]
        print(f"{row['rows']:>7} x {row['hidden']:<5} {row['unfused_graph_us']:>26.1f} {row['fused_graph_us']:>8.1f}"
              f"                {equal}")
    print(f"wrote {path}")
    if not all_equal:
        raise SystemExit("a custom all-reduce's result differs from its reference (see the *_equals_* fields)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--sizes-kb", default="8,16,64,256,1024", help="comma-separated message sizes in KiB")
    parser.add_argument("--fused-shapes", default="1x4096,16x4096,64x4096,1x8192,16x8192",
                        help="comma-separated rows x hidden for the fused all-reduce + add + RMSNorm")
    args = parser.parse_args()
    if torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"{args.gpus} GPUs asked for, {torch.cuda.device_count()} here")
    port = free_port("")
    sizes = [int(kb) << 10 for kb in args.sizes_kb.split(",")]
    fused_shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.fused_shapes.split(",")]
    mp.spawn(rank_main, args=(args.gpus, port, sizes, fused_shapes), nprocs=args.gpus)  # raises where a rank fails


if __name__ == "__main__":
    main()
