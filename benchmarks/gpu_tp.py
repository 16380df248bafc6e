"""Tensor and pipeline parallelism: batch-1 decode of dummy llama-3.1-8b bf16 at TP=1, 2, 4
(and any TP x PP layout asked for), each beside the bandwidth limit of its GPUs.

The limit of a TP=N step is what one GPU reads (its weight shard, its KV heads' cache) over that
GPU's measured copy bandwidth: the ranks read in parallel, and the collectives (2 all-reduces a
layer, one for the embedding, an all-gather of the logits, a broadcast of the sampled token) are
the overhead the measurement shows. Targets: TP=2 >= 1.7x TP=1 tok/s, TP=4 >= 2.5x.

A layout NxM is TP=N in each of M pipeline stages (N x M GPUs). Its stages run one after another
(no micro-batches in flight yet, and batch-1 decode has nothing to overlap anyway), so its limit is
the sum over stages of a stage's read over one GPU's bandwidth: TP=N's limit; what PP buys is memory
(weight_bytes: the largest stage's share a GPU holds), and what it costs (the hand-offs, one
[2, 1, hidden] send a stage boundary a token, and no CUDA graphs under PP) is the gap to TP=N.

Each size runs in this process's engine (TP=1: the worker in this process, as the engine runs by
default; TP>1: one worker process per GPU, NCCL). NCCL's NVLink multicast stays off
(NCCL_NVLS_ENABLE=0, set here for the workers to inherit). CUDA graphs capture the collectives
unless --enforce-eager. Each TP>1 layout runs once per all-reduce of --all-reduce: fused (the
default: small all-reduces on symmetric memory, those before a residual add + RMSNorm in one kernel
with it, ops/all_reduce_norm.py), custom (the one-shot all-reduce on symmetric memory alone,
model/custom_all_reduce.py, then the norm's kernel) and nccl (--disable-custom-all-reduce). Where the
custom ones cannot be set up the engine takes NCCL: each row records the one its engine used.

  python benchmarks/gpu_tp.py [--sizes 1,2,4,1x2,2x2] [--enforce-eager] [--all-reduce fused,custom,nccl]
      (on an nvidia-h100-x2 / -x4)
  python benchmarks/gpu_tp.py --smoke   (CPU, gloo, dummy:tiny float32, TP=1, 2, PP=2 and 2x2)
  python benchmarks/gpu_tp.py --host-overhead [--smoke]   (what the worker processes cost a step)

--offline N: after each layout's decode runs, the same engine runs N ShareGPT-like requests offline
(gpu_engine.py's lengths and prompts: the offline batch measured for the 70B at TP=4); give
it --max-num-seqs (default 16, what batch-1 decode needs) to let the batch grow.

--host-overhead runs batch-1 decode at TP=1 with the worker in the engine's process, TP=1 with it in
a process of its own (executor_backend mp) and TP=2, and reports per step its wall time and the part
of it spent outside rank 0's worker (building inputs, forward, sampling): the engine's own work and
the executor's messages, unless async scheduling hides them behind the device's work.

Writes $OUT/gpu_tp.json (or gpu_tp_smoke.json, gpu_tp_host.json) and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before any NCCL communicator exists (workers inherit it)
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # the custom all-reduce's buffer: no multicast

import numpy as np  # noqa: E402
import torch  # noqa: E402

from goodserve import LLM, SamplingParams  # noqa: E402
from goodserve.config import KernelOptions  # noqa: E402
from goodserve.model.llama import build_empty_model  # noqa: E402
from goodserve.model.pipeline_parallel import PipelineParallel  # noqa: E402
from goodserve.model.presets import get_preset  # noqa: E402
from goodserve.model.tensor_parallel import TensorParallel  # noqa: E402
from result_file import write_result  # noqa: E402

PROMPT_LEN = 128


def copy_bandwidth_gbps(device: str) -> float:
    """Read + write bytes per second of a large copy: what a GPU (or the CPU) can stream."""
    if device == "cuda":
        import gpu_engine

        return gpu_engine.copy_bandwidth_gbps()
    src = torch.randn(1 << 24)
    dst = torch.empty_like(src)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    return 2 * src.numel() * 4 * 10 / (time.perf_counter() - start) / 1e9


def bytes_per_gpu(preset: str, tp: int, pp: int, dtype: torch.dtype, new_tokens: int) -> dict:
    """What one rank of each stage reads per decode step, summed over the stages (they run one after
    another): its weights (one embedding row, not its table, unless the table is its lm_head; of a
    mixture of experts its share of the routed experts) and its KV heads' cache of its layers at the
    decode's mean context; weight_bytes: the most a GPU holds."""
    spec = get_preset(preset)
    weights, read = [], 0
    for stage in range(pp):
        model = build_empty_model(spec, dtype, "meta", TensorParallel(rank=0, size=tp),
                                  PipelineParallel(stage, pp, tp))
        weights.append(sum(p.numel() * p.element_size() for p in model.parameters()))
        embedding = model.model.embed_tokens
        table_is_head = model.lm_head is not None and spec.tie_word_embeddings
        table = 0 if embedding is None or table_is_head else embedding.weight.numel() * embedding.weight.element_size()
        read += weights[-1] - table
        local = model.pp.local_spec(model.tp.local_spec(spec))
        read += local.kv_bytes_per_token(dtype.itemsize) * (PROMPT_LEN + new_tokens // 2)
        if spec.is_moe:  # a token reads its routed experts' share only
            unrouted = spec.num_experts - spec.num_experts_per_tok
            read -= local.num_layers * unrouted * local.expert_params() * dtype.itemsize
    return {"weight_bytes": max(weights), "step_read_bytes": read}


def decode_tok_s(llm: LLM, new_tokens: int) -> list[dict]:
    prompt = {"prompt_token_ids": list(np.random.default_rng(0).integers(100, 500, PROMPT_LEN))}
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=min(16, new_tokens), ignore_eos=True))  # warm-up
    runs = []
    for _ in range(3):
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))[0]
        times = out.metrics.token_times
        runs.append({"decode_tok_s": (new_tokens - 1) / (times[-1] - times[0]), "token_ids": out.outputs[0].token_ids})
    return runs


def measure(args: argparse.Namespace, layout: str, all_reduce: str, bandwidth_gbps: float) -> dict:
    """layout: "N" (TP=N) or "NxM" (TP=N in each of M pipeline stages); all_reduce: fused, custom or nccl."""
    tp, pp = parse_layout(layout)
    with engine(args, tensor_parallel_size=tp, pipeline_parallel_size=pp, disable_custom_all_reduce=all_reduce == "nccl",
                kernels=KernelOptions(fuse_all_reduce_into_norm=all_reduce == "fused")) as llm:
        runs = decode_tok_s(llm, args.new_tokens)
        info = llm.engine.executor.info
        offline = run_offline(llm, args.offline) if args.offline else None
    best = max(r["decode_tok_s"] for r in runs)
    read = bytes_per_gpu(args.model.removeprefix("dummy:"), tp, pp, getattr(torch, args.dtype), args.new_tokens)
    limit = bandwidth_gbps * 1e9 / read["step_read_bytes"]
    return {"layout": layout, "tensor_parallel_size": tp, "pipeline_parallel_size": pp, "cuda_graphs": info.cuda_graphs,
            "all_reduce": info.all_reduce,
            "decode_tok_s": best,
            "runs": [r["decode_tok_s"] for r in runs], "tokens": runs[0]["token_ids"], **read,
            "bandwidth_limit_tok_s": limit, "share_of_limit": best / limit,
            **({"offline_sharegpt_like": offline} if offline else {})}


def run_offline(llm: LLM, num_requests: int) -> dict:
    import gpu_engine

    inputs, outputs = gpu_engine.sharegpt_like_lengths(num_requests)
    result = gpu_engine.run_offline(llm, gpu_engine.random_prompts(inputs, vocab_size=llm.spec.vocab_size), outputs)
    result["steps"].pop("prefill_steps")  # one entry a prefill step: too long to keep
    return result


@contextlib.contextmanager
def engine(args: argparse.Namespace, **options):
    """An LLM for batch-1 decode, its worker processes shut and its GPU memory given back after."""
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              enforce_eager=args.enforce_eager,
              quantization="none", **options)
    try:
        yield llm
    finally:
        llm.engine.executor.shutdown()
        vars(llm).clear()  # the caller's name for it outlives the block: drop what holds the GPU memory
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()


def parse_layout(layout: str) -> tuple[int, int]:
    tp, _, pp = layout.partition("x")
    return int(tp), int(pp or 1)


def runs_to_make(layouts: list[str], all_reduces: list[str]) -> list[tuple[str, str]]:
    """(layout, all-reduce) pairs: a layout without tensor parallelism once (it has no all-reduce)."""
    return [(layout, all_reduce) for layout in layouts
            for all_reduce in (all_reduces if parse_layout(layout)[0] > 1 else all_reduces[:1])]


def host_overhead(args: argparse.Namespace) -> list[dict]:
    rows = []
    for name, options in (("TP=1 uni", {}), ("TP=1 mp", {"executor_backend": "mp"}),
                          ("TP=2", {"tensor_parallel_size": 2})):
        with engine(args, **options) as llm:
            steps = llm.engine.steps
            worker_s = -(steps.prepare + steps.forward + steps.sample)
            num_steps = -steps.num_steps
            runs = decode_tok_s(llm, args.new_tokens)  # its warm-up too: the mean over every step
            worker_s += steps.prepare + steps.forward + steps.sample
            num_steps += steps.num_steps
        step_ms = 1e3 * np.mean([1 / r["decode_tok_s"] for r in runs])
        rows.append({"layout": name, "step_ms": step_ms, "outside_worker_ms": step_ms - 1e3 * worker_s / num_steps})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=None, help="comma-separated layouts: N (TP=N) or NxM (TP=N x PP=M) "
                        "(default: TP 1,2,4 up to the GPUs here)")
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (to see what capture buys)")
    parser.add_argument("--all-reduce", default="fused", help="comma-separated, of fused (the engine's default), "
                        "custom (one-shot, unfused) and nccl (--disable-custom-all-reduce); each TP>1 layout runs "
                        "once per entry")
    parser.add_argument("--dtype", default="bfloat16", help="on CUDA (float32: greedy tokens comparable across sizes)")
    parser.add_argument("--offline", type=int, default=0, help="also N ShareGPT-like requests offline per layout")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, dummy:tiny float32, TP=1, 2, PP=2, 2x2")
    parser.add_argument("--host-overhead", action="store_true",
                        help="ms a step at TP=1 in-process, TP=1 in a worker process, TP=2, and the part outside rank 0's worker")
    args = parser.parse_args()
    if not set(args.all_reduce.split(",")) <= {"fused", "custom", "nccl"}:
        parser.error("--all-reduce takes fused, custom and / or nccl")
    args.device, args.dtype = ("cpu", "float32") if args.smoke else ("cuda", args.dtype)
    if args.smoke:
        args.model, args.new_tokens, args.sizes = "dummy:tiny", 16, args.sizes or "1,2,1x2,2x2"
    if args.host_overhead:
        args.new_tokens = 128 if args.smoke else args.new_tokens
        rows = host_overhead(args)
        path = write_result("gpu_tp_host.json", {"model": args.model, "device": args.device, "steps": rows})
        for row in rows:
            print(f"{row['layout']:>9}: {row['step_ms']:.3f} ms a step, {row['outside_worker_ms']:.3f} outside rank 0's worker")
        print(f"wrote {path}")
        return
    layouts = args.sizes.split(",") if args.sizes else [str(s) for s in (1, 2, 4) if s <= torch.cuda.device_count()]
    bandwidth = copy_bandwidth_gbps(args.device)
    results = {"model": args.model, "dtype": args.dtype, "device": torch.cuda.get_device_name() if args.device == "cuda"
               else "cpu", "copy_bandwidth_gbps_per_gpu": bandwidth, "prompt_len": PROMPT_LEN,
               "new_tokens": args.new_tokens, "nccl_nvls_enable": os.environ["NCCL_NVLS_ENABLE"],
               "sizes": [measure(args, layout, all_reduce, bandwidth)
                         for layout, all_reduce in runs_to_make(layouts, args.all_reduce.split(","))]}
    base = results["sizes"][0]
    for row in results["sizes"]:
        row["speedup_over_first"] = row["decode_tok_s"] / base["decode_tok_s"]
        row["same_tokens_as_first"] = row["tokens"] == base["tokens"]
    path = write_result("gpu_tp_smoke.json" if args.smoke else "gpu_tp.json", results)
    print(f"{'TPxPP':>5} {'all-reduce':>10} {'graphs':>6} {'tok/s':>9} {'limit':>9} {'share':>6} {'speedup':>7} "
          f"same-tokens")
    for row in results["sizes"]:
        print(f"{row['layout']:>5} {str(row['all_reduce'] or '-'):>10} {str(row['cuda_graphs']):>6} "
              f"{row['decode_tok_s']:>9.1f} "
              f"{row['bandwidth_limit_tok_s']:>9.1f} {row['share_of_limit']:>6.2f} {row['speedup_over_first']:>7.2f} "
              f"{row['same_tokens_as_first']}")
    for row in results["sizes"]:
        if "offline_sharegpt_like" in row:
            offline = row["offline_sharegpt_like"]
            print(f"{row['layout']:>5} offline: {offline['requests']} ShareGPT-like requests, "
                  f"{offline['requests_per_s']:.2f} req/s, {offline['output_tok_s']:.0f} output tok/s")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
