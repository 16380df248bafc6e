"""`goodserve calc`: KV cache size, concurrency, memory fit, cost, and the fastest an offline batch can
finish, from a model's shape.

    goodserve calc kv --model llama-2-13b --batch 32 --seq-len 2048 --kv-dtype fp16
    goodserve calc kv --num-layers 40 --hidden-size 5120 --num-heads 40 --batch 32 --seq-len 2048
    goodserve calc fit --model llama-3.1-70b --gpu h100-sxm --tp 4 --seq-len 8192 --batch 16
    goodserve calc fit --model llama-3.1-8b --gpus 8 --goal throughput --prompt-len 8000 --tpot-ms 50
    goodserve calc fit --model llama-3.1-70b --tp 2 --pp 2 --batch 32 --pipeline-micro-batches
    goodserve calc cost --gpu-hourly-cost 2.5 --tokens-per-s 2400
    goodserve calc cost --gpu-hourly-cost 2.5 --tokens-per-s 2400 --batch-tokens-per-s 9000
    goodserve calc batch --model llama-3.1-8b --dataset-name sharegpt-offline --num-prompts 500
    goodserve calc batch --model llama-3.1-8b --prompt-len 1000 --output-len 200 --num-prompts 256 --json
"""

from __future__ import annotations

import argparse
import math

from goodserve.console import make_console
from goodserve.diagnose.calc import (DTYPE_BYTES, cost_per_million_tokens, decode_weight_bytes, kv_cache_bytes,
                                     kv_heads_per_gpu, max_concurrent_sequences, weight_bytes, window_saving)
from goodserve.diagnose.calc_batch import register_batch
from goodserve.diagnose.parallel import (ALLREDUCE_LATENCY_S, LAYER_LATENCY_S, Layout, add_layout_arguments,
                                         advise_layout, allreduce_payload_bytes, decode_limit, decode_tokens_per_s,
                                         dtype_for_activations, engine_default_micro_batches, handoff_bytes,
                                         layout_fit, ring_bytes_sent, stages_in_flight)
from goodserve.diagnose.model_shape import resolve_spec
from goodserve.errors import InvalidRequestError
from goodserve.hardware import get_hardware
from goodserve.model.spec import ModelSpec


def register(subparsers) -> None:
    p = subparsers.add_parser("calc", help="KV cache size, concurrency, memory fit, cost per 1M tokens, an offline "
                                           "batch's floor time",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="calc_action", metavar="WHAT", required=True)

    kv = actions.add_parser("kv", help="KV cache bytes, and sequences a memory budget holds")
    _add_model_arguments(kv)
    kv.add_argument("--batch", type=int, default=1)
    kv.add_argument("--seq-len", type=int, default=4096)
    kv.add_argument("--memory-gb", type=float, help="KV budget (decimal GB): how many sequences fit")
    kv.set_defaults(func=_kv)

    fit_p = actions.add_parser("fit", help="per-GPU memory, all-reduce traffic and decode limit of a parallel "
                                           "layout, and the layout that pays")
    _add_model_arguments(fit_p)
    fit_p.add_argument("--gpu", default="h100-sxm")
    # The engine's own default on --gpu, so calc describes what `goodserve serve` would run there.
    add_layout_arguments(fit_p, "the layout", "the engine's: on for --gpu cpu, off on a GPU")
    fit_p.add_argument("--batch", type=int, default=1)
    fit_p.add_argument("--seq-len", type=int, default=4096)
    fit_p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="weight dtype")
    fit_p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    fit_p.add_argument("--allreduce-latency-us", type=float, default=ALLREDUCE_LATENCY_S * 1e6,
                       help="what one small all-reduce costs a decode step (the one-shot all-reduce in a CUDA "
                            "graph on NVLink, measured on H100s)")
    fit_p.add_argument("--layer-latency-us", type=float, default=LAYER_LATENCY_S * 1e6,
                       help="what a decoder layer's kernels cost a decode step beyond their bytes (fitted to "
                            "batch-1 decode on H100s, CUDA graphs)")
    fit_p.add_argument("--gpus", type=int, help="GPUs to spend, for the advice (default: the layout's)")
    fit_p.add_argument("--goal", choices=("throughput", "latency"), default="throughput",
                       help="what the advice optimizes: tokens/s over all GPUs, or one sequence's TPOT")
    fit_p.add_argument("--prompt-len", type=int, help="typical prompt tokens: advise disaggregation when their "
                                                      "prefill outlasts --tpot-ms")
    fit_p.add_argument("--tpot-ms", type=float, default=100.0, help="TPOT target, for the disaggregation advice")
    fit_p.set_defaults(func=_fit)

    cost = actions.add_parser("cost", help="$ per 1M tokens from $/GPU-hour and throughput")
    cost.add_argument("--gpu-hourly-cost", type=float, required=True)
    cost.add_argument("--tokens-per-s", type=float, required=True,
                      help="online: the tokens/s served within the SLOs (goodput's tokens)")
    cost.add_argument("--batch-tokens-per-s", type=float,
                      help="batch jobs: the engine's saturated tokens/s (a full batch, no latency targets); "
                           "prices batch tokens beside online ones")
    cost.add_argument("--num-gpus", type=int, default=1)
    cost.set_defaults(func=_cost)
    register_batch(actions)


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="preset, dummy:<preset>, .gguf or HF dir; or give the shape below")
    p.add_argument("--num-layers", type=int)
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--num-heads", type=int)
    p.add_argument("--num-kv-heads", type=int, help="default: --num-heads (MHA)")
    p.add_argument("--head-dim", type=int, help="default: hidden / heads")
    p.add_argument("--kv-dtype", choices=sorted(DTYPE_BYTES), default="fp16")


def spec_from_args(args) -> ModelSpec:
    if args.model:
        return resolve_spec(args.model)
    if not (args.num_layers and args.hidden_size and args.num_heads):
        raise InvalidRequestError("give --model, or --num-layers, --hidden-size and --num-heads")
    heads = args.num_heads
    return ModelSpec(name="custom", vocab_size=0, hidden_size=args.hidden_size, intermediate_size=0,
                     num_layers=args.num_layers, num_heads=heads, num_kv_heads=args.num_kv_heads or heads,
                     head_dim=args.head_dim or args.hidden_size // heads, max_position_embeddings=0)


def _kv(args) -> int:
    spec = spec_from_args(args)
    total = kv_cache_bytes(spec, args.seq_len, args.batch, args.kv_dtype)
    per_token = spec.kv_bytes_per_token(DTYPE_BYTES[args.kv_dtype])
    console = make_console()
    console.print(f"{spec.name}: {spec.num_layers} layers x {spec.num_kv_heads} KV heads x "
                  f"{spec.head_dim} head dim, {args.kv_dtype}")
    per_sequence = spec.kv_bytes_per_sequence(args.seq_len, DTYPE_BYTES[args.kv_dtype])
    console.print(f"KV per token: {per_token / 1024:.1f} KiB; per sequence of {args.seq_len}: "
                  f"{per_sequence / 1e9:.3f} GB")
    if spec.layer_windows:
        local = sum(w is not None for w in spec.layer_windows)
        console.print(f"sliding window: {local} of {spec.num_layers} layers keep their last {spec.smallest_window} "
                      f"tokens: a sequence of {args.seq_len} holds {window_saving(spec, args.seq_len, args.kv_dtype)}")
    console.print(f"KV for batch {args.batch} x {args.seq_len} tokens: [bold]{total / 1e9:.1f} GB[/bold] "
                  f"({total / 2**30:.1f} GiB)")
    if spec.is_moe:
        console.print(f"mixture of experts: {spec.num_experts_per_tok} of {spec.num_experts} experts per token, "
                      f"{spec.num_active_params() / 1e9:.2f} B of {spec.num_params() / 1e9:.2f} B parameters active; "
                      f"a batch-1 decode step reads {decode_weight_bytes(spec, 'bf16') / 1e9:.2f} GB of "
                      f"{weight_bytes(spec, 'bf16') / 1e9:.2f} GB of bf16 weights")
    if args.memory_gb:
        n = max_concurrent_sequences(spec, args.memory_gb * 1e9, args.seq_len, args.kv_dtype)
        console.print(f"{args.memory_gb:g} GB of KV holds {n} sequences of {args.seq_len} tokens")
    return 0


def _fit(args) -> int:
    spec = spec_from_args(args)
    gpu = get_hardware(args.gpu)
    micro_batches = args.micro_batches if args.micro_batches is not None else engine_default_micro_batches(gpu.name)
    layout = Layout(args.tp, args.pp, args.dp, micro_batches)
    report = layout_fit(spec, layout, gpu.memory_bytes, args.seq_len, args.batch, args.dtype, args.kv_dtype,
                        args.gpu_memory_utilization)
    per_replica = math.ceil(args.batch / layout.dp)
    console = make_console()
    verdict = "[green]fits[/green]" if report.fits else "[red]does not fit[/red]"
    console.print(f"{spec.name} ({args.dtype} weights, {args.kv_dtype} KV) on TP {layout.tp} x PP {layout.pp} x "
                  f"DP {layout.dp} = {layout.gpus} x {gpu.name}: {verdict}")
    console.print(f"  per GPU: usable {report.usable_bytes / 1e9:.1f} GB, weights "
                  f"{report.weight_bytes_per_gpu / 1e9:.1f} GB, KV for {per_replica} x {args.seq_len} "
                  f"{report.kv_bytes_per_gpu / 1e9:.1f} GB ({kv_heads_per_gpu(spec, layout.tp)} of "
                  f"{spec.num_kv_heads} KV heads, {math.ceil(spec.num_layers / layout.pp)} of {spec.num_layers} layers)")
    console.print(f"  KV room after weights holds {report.max_sequences} sequences of {args.seq_len} tokens "
                  f"per replica")
    act = dtype_for_activations(args.dtype)
    for what, tokens in ((f"decode step of {per_replica}", per_replica), (f"prefill of {args.seq_len}", args.seq_len)):
        payload = allreduce_payload_bytes(spec, layout.tp, layout.pp, tokens, act)
        if payload:
            console.print(f"  all-reduce per {what} tokens: {payload / 1e6:.2f} MB per GPU "
                          f"({2 * math.ceil(spec.num_layers / layout.pp)} all-reduces), ring sends "
                          f"{ring_bytes_sent(payload, layout.tp) / 1e6:.2f} MB")
        if layout.pp > 1:
            console.print(f"  stage handoffs per {what} tokens: {layout.pp - 1}, each "
                          f"{handoff_bytes(spec, tokens, act) / 1e6:.2f} MB (hidden states and residual) from every "
                          f"GPU of a stage to its peer in the next")
    limit = decode_limit(spec, gpu, layout, args.seq_len, 1, args.dtype, args.kv_dtype, args.allreduce_latency_us / 1e6,
                         args.layer_latency_us / 1e6)
    console.print(f"  one sequence at {args.seq_len} tokens of context decodes at ~"
                  f"{limit.bandwidth_tokens_per_s:.0f} tok/s by bandwidth alone (its reads at the "
                  f"{gpu.copy_bandwidth / 1e9:.0f} GB/s a copy reaches of the datasheet's "
                  f"{gpu.memory_bandwidth / 1e9:.0f}); expect ~{limit.tokens_per_s:.0f} tok/s "
                  f"with the layers' kernel latencies ({1000 * limit.layers_s:.2f} ms) and the collectives "
                  f"({1000 * limit.allreduce_s:.2f} ms all-reduce, {1000 * limit.handoff_s:.2f} ms stage handoffs) "
                  f"per token")
    if layout.pp > 1:
        _print_pipeline_throughput(console, spec, gpu, layout, args, per_replica)
    advice = advise_layout(spec, gpu, args.gpus or layout.gpus, args.goal, args.seq_len, args.batch, args.dtype,
                           args.kv_dtype, args.gpu_memory_utilization, args.prompt_len, args.tpot_ms / 1000,
                           micro_batches)
    if advice:
        console.print(f"advice ({args.goal}, {args.gpus or layout.gpus} GPUs):")
    for item in advice:
        console.print(f"  - [cyan]{item.option}[/cyan]: {item.why}")
    return 0 if report.fits else 1


def _print_pipeline_throughput(console, spec: ModelSpec, gpu, layout: Layout, args, batch: int) -> None:
    """Decode throughput of a replica at its batch, one step at a time and with micro-batches: the
    layout's setting marked, each sequence's token time beside (one pass through the stages)."""
    console.print(f"  decode at a batch of {batch} a replica, {args.seq_len} tokens of context:")
    for micro_batches in (False, True):
        mode = Layout(layout.tp, layout.pp, layout.dp, micro_batches)
        tokens_per_s, token_s = decode_tokens_per_s(spec, gpu, mode, args.seq_len, batch, args.dtype, args.kv_dtype,
                                                    args.allreduce_latency_us / 1e6, args.layer_latency_us / 1e6)
        steps = stages_in_flight(mode, batch)
        how = (f"micro-batches ({steps} in the stages at once, ~{math.ceil(batch / steps)} sequences each)"
               if micro_batches else "one step at a time")
        ours = "  <- this layout" if micro_batches == layout.micro_batches else ""
        console.print(f"    {how}: ~{tokens_per_s:.0f} tok/s, each sequence a token every {1000 * token_s:.2f} ms"
                      f"{ours}")


def _cost(args) -> int:
    """Online tokens are priced at the rate the SLOs allow; batch tokens (--batch-tokens-per-s) at the
    full batch's rate, so the same GPU-hour buys more of them."""
    console = make_console()
    online = cost_per_million_tokens(args.gpu_hourly_cost, args.tokens_per_s, args.num_gpus)
    where = f"on {args.num_gpus} GPU(s) at ${args.gpu_hourly_cost:g}/GPU-hour"
    if args.batch_tokens_per_s is None:
        console.print(f"${online:.4f} per 1M tokens at {args.tokens_per_s:g} tok/s {where}")
        return 0
    batch = cost_per_million_tokens(args.gpu_hourly_cost, args.batch_tokens_per_s, args.num_gpus)
    console.print(f"online: ${online:.4f} per 1M tokens at {args.tokens_per_s:g} tok/s {where}")
    console.print(f"batch:  ${batch:.4f} per 1M tokens at {args.batch_tokens_per_s:g} tok/s "
                  f"({online / batch:.2f}x cheaper than online)")
    return 0
