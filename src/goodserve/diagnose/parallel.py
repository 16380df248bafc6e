"""Parallel layouts on paper: TP x PP GPUs per replica, DP replicas. What each GPU holds, what the
GPUs send each other per step, how fast one sequence can decode, and which layout pays.

- Memory per GPU: weights / (TP x PP); KV for its layers (L / PP) and its KV heads (split by TP,
  one whole head per GPU when TP exceeds the KV heads: the head is replicated, not cut).
- Tensor parallelism all-reduces the hidden state twice per layer (after attention's o and the
  MLP's down projection): 2 x layers x hidden x tokens x activation bytes per step. A ring
  all-reduce moves 2 (N - 1) / N of that payload over each GPU's link.
- Decode of one sequence reads every weight once per token (of an untied embedding table one row).
  TP splits that read over N GPUs' bandwidth but adds 2 x layers all-reduces, whose latency (not
  their bytes: 16 KB each for an 8B model) decides small-batch speed. PP stages run one after
  another for a token: no faster, and one step at a time no more throughput either. Each stage
  hands the next its hidden states and residual ([2, tokens, hidden]) once a step.
- Pipeline micro-batches (the engine's --pipeline-micro-batches): at a batch of B, min(M, B) steps
  of ~B / min(M, B) sequences each are in the M stages at once, so that many stages' bandwidth and
  FLOP/s work together; but each micro-batch reads its stages' weights again, so a decode round
  (a token for every sequence) takes one pass through the stages over a micro-batch's rows where one
  step at a time takes one over all B. They pay where a step's time grows with its rows (KV reads,
  FLOPs), not while the weight read dominates; one sequence's token still crosses every stage.
- Advice: a model that does not fit one GPU needs TP (the smallest N that fits; PP across nodes
  past 8 GPUs, with micro-batches for throughput once a replica has a sequence for every stage);
  one that fits runs faster per GPU as replicas (no collectives) when throughput is the goal, with
  TP when per-token latency is; long prompts whose prefill takes longer than the TPOT target stall
  every colocated decode: disaggregate prefill and decode.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

from goodserve.diagnose.calc import FitReport, decode_weight_bytes, dtype_bytes, fit, kv_heads_per_gpu
from goodserve.diagnose.observations import Observations
from goodserve.diagnose.roofline import (PhaseAnalysis, analyze_decode, analyze_prefill, flops_per_token,
                                         prefill_flops)
from goodserve.errors import InvalidRequestError
from goodserve.hardware import Hardware
from goodserve.model.spec import ModelSpec

# What an all-reduce of a decode step's few KB costs inside the step, one host, the engine's all-reduce
# fused with the residual add and RMSNorm after it (ops/all_reduce_norm.py), CUDA graphs. Alone, with
# the norm, it takes 4.7-6.4 us at 1 x 4096-8192 bf16 rows on 2 H100s (10.3-10.8 unfused;
# benchmarks/results/gpu_allreduce_fused_h100x2.json); in the step each waits for the slowest rank's
# kernels too: on 4 H100s (NV18) batch-1 decode lost 7.1 / 7.4 us an all-reduce beyond TP=1's per-layer
# cost at TP=2 / 4 for llama-3.1-8b and 10.4 us for llama-3.1-70b at TP=4 (13.1 / 11.7 / 12.4 with the
# one-shot all-reduce and a separate norm; gpu_tp_fused_h100x4.json, gpu_tp_70b_fused_h100x4.json).
# --allreduce-latency-us: another interconnect's.
ALLREDUCE_LATENCY_S = 8.5e-6
# What a decoder layer's ~8 kernels cost a decode step beyond the bytes they read (launch and
# dependency latencies, inside a CUDA graph), the bytes at the bandwidth a copy reaches: least squares
# on the relative error of decode_limit's batch-1 predictions at a 256-token context against the
# engine on H100s, llama-3.1-8b at TP 1 / 2 / 4 (170.5 / 263.4 / 390.6 tok/s;
# benchmarks/results/gpu_tp_fused_h100x4.json) and llama-3.1-70b at TP 4 (65.2;
# gpu_tp_70b_fused_h100x4.json), the all-reduces at ALLREDUCE_LATENCY_S: 24.6 us, within 3% of each.
# Every rank pays it at any TP. --layer-latency-us: another GPU's or kernel set's.
LAYER_LATENCY_S = 24.6e-6
NODE_GPUS = 8  # past one node's GPUs, TP's all-reduces would cross the network: PP there instead
# Micro-batches measured against one step at a time at PP=2 (benchmarks/BENCHMARKS.md): on CUDA the
# stages run eagerly (the hand-off is not in a CUDA graph), so a step's host time bounds it whatever
# its rows, and twice the steps lost; on the CPU a stage's time grows with its rows, and they won.
MICRO_BATCHES_MEASURED_CUDA = ("on 2 H200s micro-batches measured 0.88x of one step at a time "
                               "(benchmarks/results/gpu_pipeline_microbatch_h200x2.json)")
MICRO_BATCHES_MEASURED_CPU = ("on a 2-core CPU micro-batches measured 1.29x of one step at a time "
                              "(benchmarks/results/cpu_pipeline_microbatch_intel.json)")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batches: bool = False  # the PP stages work on micro-batches at once (--pipeline-micro-batches)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def flags(self) -> str:
        parts = [f"--tensor-parallel-size {self.tp}"] if self.tp > 1 else []
        parts += [f"--pipeline-parallel-size {self.pp}"] if self.pp > 1 else []
        parts += [f"--data-parallel-size {self.dp}"] if self.dp > 1 else []
        return " ".join(parts) or "one GPU"


def add_layout_arguments(parser, what: str, micro_batches_default: str) -> None:
    """--tensor-parallel-size / --pipeline-parallel-size / --data-parallel-size (short: --tp, --pp,
    --dp) and --pipeline-micro-batches / --no-pipeline-micro-batches (None when not given) of `what`
    (calc's layout, or the layout a diagnosed run used)."""
    parser.add_argument("--tensor-parallel-size", "--tp", dest="tp", type=int, default=1,
                        help=f"GPUs {what} splits each layer over (heads, columns)")
    parser.add_argument("--pipeline-parallel-size", "--pp", dest="pp", type=int, default=1,
                        help=f"GPUs {what} splits the layers over, in contiguous stages")
    parser.add_argument("--data-parallel-size", "--dp", dest="dp", type=int, default=1,
                        help=f"replicas of TP x PP GPUs {what} spreads the requests over")
    parser.add_argument("--pipeline-micro-batches", dest="micro_batches", action=argparse.BooleanOptionalAction,
                        help=f"whether {what}'s pipeline stages work on micro-batches at once, as the engine's "
                             f"flag (default: {micro_batches_default})")


def engine_default_micro_batches(hardware: str) -> bool:
    """The engine's default (engine/setup/config_resolution.py): on on the CPU, off on CUDA."""
    return hardware == "cpu"


def check_layout(spec: ModelSpec, layout: Layout) -> None:
    if min(layout.tp, layout.pp, layout.dp) < 1:
        raise InvalidRequestError("parallel sizes must be at least 1")
    if spec.num_heads % layout.tp:
        raise InvalidRequestError(f"--tensor-parallel-size {layout.tp} must divide {spec.num_heads} heads")
    if layout.pp > spec.num_layers:
        raise InvalidRequestError(f"--pipeline-parallel-size {layout.pp} exceeds {spec.num_layers} layers")


def layout_fit(spec: ModelSpec, layout: Layout, gpu_memory_bytes: float, seq_len: int, batch: int,
               dtype: str, kv_dtype: str, gpu_memory_utilization: float) -> FitReport:
    """Memory per GPU; the batch is spread over the replicas (each holds its share's KV)."""
    check_layout(spec, layout)
    return fit(spec, gpu_memory_bytes, layout.tp, seq_len, math.ceil(batch / layout.dp), dtype, kv_dtype,
               gpu_memory_utilization, pp=layout.pp)


def allreduce_payload_bytes(spec: ModelSpec, tp: int, pp: int, tokens: int, act_dtype: str = "bf16") -> float:
    """Bytes all-reduced per step by each GPU: 2 per layer of its stage x hidden x tokens."""
    if tp == 1:
        return 0.0
    return 2 * math.ceil(spec.num_layers / pp) * spec.hidden_size * tokens * dtype_bytes(act_dtype)


def ring_bytes_sent(payload_bytes: float, tp: int) -> float:
    """A ring all-reduce (reduce-scatter + all-gather) sends 2 (N - 1) / N of the payload per GPU."""
    return payload_bytes * 2 * (tp - 1) / tp


@dataclass
class DecodeLimit:
    read_s: float  # reading weights + KV at the bandwidth a copy reaches, per token
    allreduce_s: float  # the all-reduces' latency and bytes on the link
    handoff_s: float  # PP: one send between consecutive stages each
    layers_s: float = 0.0  # each layer's kernel latencies beyond its bytes
    compute_s: float = 0.0  # the FLOPs at peak: below read_s until a batch passes the ridge

    @property
    def token_s(self) -> float:
        return max(self.read_s, self.compute_s) + self.layers_s + self.allreduce_s + self.handoff_s

    @property
    def bandwidth_tokens_per_s(self) -> float:
        """The limit if the layers' latencies and the collectives were free."""
        return 1.0 / self.read_s

    @property
    def tokens_per_s(self) -> float:
        """What to expect: the bytes at a copy's bandwidth (or the FLOPs at peak), each layer's latencies
        and the collectives."""
        return 1.0 / self.token_s


def decode_limit(spec: ModelSpec, hw: Hardware, layout: Layout, context_len: int = 0, batch: int = 1,
                 dtype: str = "bf16", kv_dtype: str = "bf16", allreduce_latency_s: float = ALLREDUCE_LATENCY_S,
                 layer_latency_s: float = LAYER_LATENCY_S) -> DecodeLimit:
    """One decode step of `batch` sequences on one replica: each GPU reads its weights (1 / TP of
    them in turn, stage after stage) and its KV heads at the bandwidth a copy reaches (3.0 of the
    datasheet's 3.35 TB/s on an H100: hardware.py's copy_bandwidth), or computes its share of the
    FLOPs at peak where they take longer, and pays each layer's kernel latencies, then the
    all-reduces and stage handoffs. On H100s at a 256-token context this predicts llama-3.1-8b batch 1
    at 172 / 260 / 387 tok/s for TP 1 / 2 / 4 (measured 170.5 / 263.4 / 390.6) and llama-3.1-70b at
    TP 4 67 tok/s (measured 65.2), where the bandwidth alone says 199 / 399 / 798 and 86."""
    kv_per_token = 2 * spec.num_layers * kv_heads_per_gpu(spec, layout.tp) * spec.head_dim * dtype_bytes(kv_dtype)
    weights = decode_weight_bytes(spec, dtype, batch) / layout.tp
    read = (weights + batch * context_len * kv_per_token) / hw.copy_bandwidth
    act = dtype_for_activations(dtype)
    compute = batch * flops_per_token(spec, context_len) / (layout.tp * hw.flops_for(act))
    allreduce = 0.0
    if layout.tp > 1:
        count = 2 * spec.num_layers
        sent = ring_bytes_sent(allreduce_payload_bytes(spec, layout.tp, 1, batch, act), layout.tp)
        allreduce = count * allreduce_latency_s + (sent / hw.link_bandwidth if hw.link_bandwidth else 0.0)
    return DecodeLimit(read, allreduce, (layout.pp - 1) * allreduce_latency_s, spec.num_layers * layer_latency_s,
                       compute)


def handoff_bytes(spec: ModelSpec, tokens: int, act_dtype: str = "bf16") -> float:
    """What a stage sends the next per step, from each of its TP ranks: hidden states and residual."""
    return 2 * tokens * spec.hidden_size * dtype_bytes(act_dtype)


def stages_in_flight(layout: Layout, batch: float) -> int:
    """Stages busy at once in a decode round: with micro-batches one a stage, each of its own
    sequences (so at most `batch` of them); one step at a time, one."""
    if not layout.micro_batches:
        return 1
    return max(1, min(layout.pp, math.floor(batch)))


def decode_tokens_per_s(spec: ModelSpec, hw: Hardware, layout: Layout, context_len: int, batch: int,
                        dtype: str = "bf16", kv_dtype: str = "bf16", allreduce_latency_s: float = ALLREDUCE_LATENCY_S,
                        layer_latency_s: float = LAYER_LATENCY_S) -> tuple[float, float]:
    """One replica's decode throughput at `batch` sequences, and each sequence's seconds a token. A
    round (a token for every sequence) is one pass through the stages over a step's rows: all `batch`
    one step at a time; with micro-batches the k = stages_in_flight steps of batch / k rows pass at
    once (each stage takes k of them a round, at most the M a pass holds)."""
    rows = math.ceil(batch / stages_in_flight(layout, batch))
    token_s = decode_limit(spec, hw, layout, context_len, rows, dtype, kv_dtype, allreduce_latency_s,
                           layer_latency_s).token_s
    return batch / token_s, token_s


def dtype_for_activations(weight_dtype: str) -> str:
    """Weight-only quantized models compute (and all-reduce) in bf16."""
    return "bf16" if weight_dtype in ("int8", "int4", "auto") else weight_dtype


def replica_hardware(hw: Hardware, layout: Layout, batch: float = 1) -> Hardware:
    """One replica's TP x PP GPUs as one device for the roofline of a step over `batch` sequences: TP
    multiplies the FLOP/s and the bandwidth it uses, and so do the stages in flight (PP stages take
    turns on a step, so only micro-batches keep more than one busy); TP x PP multiply memory."""
    if layout.tp * layout.pp == 1:
        return hw
    busy = stages_in_flight(layout, batch)
    n = layout.tp * busy
    in_flight = f", {busy} stages in flight" if busy > 1 else ""
    return dataclasses.replace(hw, name=f"{layout.tp * layout.pp} x {hw.name} (TP {layout.tp}, PP {layout.pp}"
                                        f"{in_flight})",
                               peak_flops={k: v * n for k, v in hw.peak_flops.items()},
                               memory_bandwidth=hw.memory_bandwidth * n,
                               memory_bytes=hw.memory_bytes * layout.tp * layout.pp)


def per_replica(obs: Observations, layout: Layout) -> Observations:
    """A run measured through a router over DP replicas, as one replica saw it: its share of the
    requests in flight (latencies are each request's own)."""
    return dataclasses.replace(obs, concurrency=obs.concurrency / layout.dp)


def analyze_replica(spec: ModelSpec, hw: Hardware, obs: Observations, layout: Layout = Layout(), dtype: str = "bf16",
                    kv_dtype: str = "bf16", compute_dtype: str | None = None) -> list[PhaseAnalysis]:
    """Prefill and decode of one replica against its roofline. A prompt crosses the stages in turn;
    a decode round keeps the stages in flight busy, each micro-batch reading its stages' weights."""
    obs = per_replica(obs, layout)
    busy = stages_in_flight(layout, obs.concurrency)
    return [analyze_prefill(spec, replica_hardware(hw, layout), obs, dtype, kv_dtype, compute_dtype),
            analyze_decode(spec, replica_hardware(hw, layout, obs.concurrency), obs, dtype, kv_dtype, compute_dtype,
                           weight_reads=busy)]


@dataclass
class LayoutAdvice:
    option: str  # the flags that apply it
    why: str


def smallest_fitting_layout(spec: ModelSpec, gpu_memory_bytes: float, seq_len: int, batch: int, dtype: str,
                            kv_dtype: str, gpu_memory_utilization: float) -> Layout | None:
    """TP first (powers of two dividing the heads, up to a node), then PP stages of a full node."""
    tps = [n for n in (1, 2, 4, 8) if n <= NODE_GPUS and spec.num_heads % n == 0]
    candidates = [Layout(tp=n) for n in tps] + [Layout(tp=tps[-1], pp=p) for p in range(2, spec.num_layers + 1)]
    for layout in candidates:
        if layout_fit(spec, layout, gpu_memory_bytes, seq_len, batch, dtype, kv_dtype, gpu_memory_utilization).fits:
            return layout
    return None


def micro_batch_advice(spec: ModelSpec, hw: Hardware, layout: Layout, seq_len: int, batch: int, dtype: str,
                       kv_dtype: str) -> LayoutAdvice:
    """Micro-batches for a replica of `layout` at `batch` sequences, with the gain this model gives
    them and what the engine measured: on CUDA the host time of an eager stage's step decides."""
    off, _ = decode_tokens_per_s(spec, hw, dataclasses.replace(layout, micro_batches=False), seq_len, batch, dtype,
                                 kv_dtype)
    on, _ = decode_tokens_per_s(spec, hw, dataclasses.replace(layout, micro_batches=True), seq_len, batch, dtype,
                                kv_dtype)
    measured = (MICRO_BATCHES_MEASURED_CPU if hw.name == "cpu" else
                f"on CUDA they pay only once each stage's step is not host-bound: the stages run without CUDA "
                f"graphs today, and {MICRO_BATCHES_MEASURED_CUDA}")
    return LayoutAdvice("--pipeline-micro-batches",
                        f"{batch} sequences a replica fill its {layout.pp} stages at once: ~{on:.0f} tok/s a replica "
                        f"against ~{off:.0f} one step at a time by the roofline ({on / off:.2f}x: they split a step's "
                        f"KV reads and FLOPs, not its weight read, which each micro-batch repeats); {measured}")


def advise_layout(spec: ModelSpec, hw: Hardware, gpus: int, goal: str, seq_len: int, batch: int,
                  dtype: str = "bf16", kv_dtype: str = "bf16", gpu_memory_utilization: float = 0.9,
                  prompt_len: int | None = None, tpot_target_s: float | None = None,
                  micro_batches: bool = False) -> list[LayoutAdvice]:
    """goal: "throughput" (tokens/s over all GPUs) or "latency" (one sequence's TPOT). micro_batches:
    whether the pipeline stages run them already (so they are not advised again)."""
    base = smallest_fitting_layout(spec, hw.memory_bytes, seq_len, batch, dtype, kv_dtype, gpu_memory_utilization)
    if base is None:
        return [LayoutAdvice("a smaller dtype (--dtype int8 / int4)",
                             f"{spec.name} does not fit {hw.name}s at any layout tried")]
    advice = []
    group = base.tp * base.pp
    if group > 1:
        advice.append(LayoutAdvice(base.flags(), f"the smallest layout on which weights + KV for {batch} x {seq_len} "
                                                 f"tokens fit"))
    replicas = max(1, gpus // group)
    if goal == "throughput" and replicas > 1:
        advice.append(LayoutAdvice(Layout(base.tp, base.pp, replicas).flags(),
                                   f"{replicas} replicas of {group} GPU{'s' if group > 1 else ''} each: each decodes its own batch with no "
                                   f"collectives between them, so throughput grows ~{replicas}x"))
    per_replica_batch = math.ceil(batch / replicas)
    if goal == "throughput" and base.pp > 1 and not micro_batches and per_replica_batch >= base.pp:
        advice.append(micro_batch_advice(spec, hw, base, seq_len, per_replica_batch, dtype, kv_dtype))
    if goal == "latency" and group < gpus:
        tp = max(n for n in (1, 2, 4, 8) if n <= gpus // base.pp and spec.num_heads % n == 0)
        if tp > base.tp:
            now = decode_limit(spec, hw, base, seq_len, 1, dtype, kv_dtype)
            faster = decode_limit(spec, hw, Layout(tp, base.pp), seq_len, 1, dtype, kv_dtype)
            advice.append(LayoutAdvice(Layout(tp, base.pp).flags(), f"one sequence decodes at ~"
                                       f"{faster.tokens_per_s:.0f} tok/s on TP {tp} against "
                                       f"~{now.tokens_per_s:.0f} on TP {base.tp} (layer and all-reduce latencies "
                                       f"included)"))
    if prompt_len and tpot_target_s:
        prefill_s = prefill_flops(spec, prompt_len) / (hw.flops_for(dtype_for_activations(dtype)) * base.tp)
        if prefill_s > tpot_target_s:
            advice.append(LayoutAdvice("prefill / decode disaggregation (serve --disaggregate)", f"a {prompt_len}-token prefill takes >= {1000 * prefill_s:.0f} ms, "
                                       f"over the {1000 * tpot_target_s:.0f} ms TPOT target: every colocated "
                                       f"decode stalls that long (chunked prefill only spreads the stall); "
                                       f"prefill GPUs apart from decode GPUs keep TPOT flat"))
    return advice
