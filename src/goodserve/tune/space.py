"""The steps tune may take from a configuration, and what the roofline predicts each one buys.

A step changes one engine option (or two that go together: a speculative method and its k). Each
rule below looks at the bottleneck (bottleneck.py) and either predicts a factor on goodput
capacity, with the reason, or says why the step does not apply here. The predictions only order
the steps: every step tried is measured, and kept only on its measurement. Rules that depend on
what the engine has on, or the hardware allows, ask diagnose's advisor (advisor.NOT_FOR), so tune
and diagnose never disagree on what applies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from goodserve.config import EngineConfig
from goodserve.diagnose.advisor import NOT_FOR
from goodserve.model_names import gguf_model_path
from goodserve.quant.linear import CUDA_KERNEL_MAX_M
from goodserve.tune.bottleneck import Bottleneck

# A step predicted to give less than this is not worth a trial: within a measurement's noise, or slower.
MIN_PREDICTED = 1.02
# Priors where the roofline has no byte count to go on, from measured gains (benchmarks/BENCHMARKS.md).
QUEUE_GAIN = 1.3  # a batch cap or missing cache that makes requests queue
SCHEDULING_GAIN = 1.1  # prefill chunk size, async scheduling
SLO_POLICY_GAIN = 1.3  # `slo` over FCFS at 8B bf16 and these targets: 1.30-1.41x on an H200 ("SLO scheduling")
CUDA_GRAPHS_GAIN = 1.3
TP2_GAIN = 1.4  # TP 2 on H100s at batch 1 (diagnose/parallel.py)
SPECULATION_GAIN = 1.25
# fp8 where TTFT or compute bounds: GEMMs at twice bf16's tensor FLOP/s, less what they do not cover
# (attention, the activations' quantization). A prior, not yet measured.
FP8_COMPUTE_GAIN = 1.3


@dataclass(frozen=True)
class Step:
    changes: dict  # engine options this step sets
    predicted: float | None  # factor on capacity; None: does not apply (why says so)
    why: str

    @property
    def name(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.changes.items())


def options_key(options: dict) -> str:
    """One configuration's identity in the trial log."""
    return json.dumps(options, sort_keys=True)


def _label(b: Bottleneck, key: str, default: str = "") -> str:
    return b.engine.get(key, default)


def weight_quantization(b: Bottleneck) -> list[Step]:
    current = _label(b, "quantization", "none")
    values = (["gguf"] if _gguf_model(b) else []) + ["int4", "int8"] + (["fp8"] if b.fp8_tensor_cores else [])
    steps, current_bytes = [], b.read_bytes_of(current)
    for value in values:
        if value == current:
            continue
        ratio = b.read_bytes_of(value) / current_bytes
        gain = b.decode_speedup(weight_ratio=ratio)
        what = (f"the weights a decode step reads {ratio:.2f}x the bytes of {current}'s: a bandwidth-bound decode "
                f"step {gain:.2f}x as fast")
        if value == "fp8":
            steps.append(_fp8_step(b, gain, what))
        elif b.device == "cpu" and value == "int8":
            steps.append(Step({"quantization": value}, None, "the CPU has no native int8 kernel (measured slower "
                                                              "than float32); its 4-bit paths have one"))
        elif b.device == "cuda" and b.concurrency > CUDA_KERNEL_MAX_M:  # GGUF codes are int4 layers too
            steps.append(Step({"quantization": value}, None,
                              f"~{b.concurrency:.0f} rows a decode step: past {CUDA_KERNEL_MAX_M} rows a {value} "
                              "matmul on CUDA dequantizes its weights first (reads the codes, writes and reads a "
                              "16-bit copy), more bytes than 16-bit weights, not fewer"))
        elif b.limiting_slo == "ttft" and b.decode_verdict != "bandwidth-bound":
            steps.append(Step({"quantization": value}, None, f"TTFT breaks first and decode is {b.decode_verdict}: "
                                                              "weight-only quantization does not shorten prefill"))
        else:
            steps.append(Step({"quantization": value}, gain, what))
    return steps


def _fp8_step(b: Bottleneck, gain: float, what: str) -> Step:
    """FP8 GEMMs at any batch size (no dequantization past a row count): half bf16's weight bytes, and
    twice its tensor FLOP/s where compute or TTFT bounds."""
    if b.limiting_slo == "ttft" or b.decode_verdict == "compute-bound":
        return Step({"quantization": "fp8"}, FP8_COMPUTE_GAIN,
                    f"{'TTFT breaks first' if b.limiting_slo == 'ttft' else 'decode is compute-bound'}: fp8 weights "
                    "and activations run the GEMMs on FP8 tensor cores at twice bf16's FLOP/s")
    return Step({"quantization": "fp8"}, gain, f"{what} (FP8 GEMMs at every batch size)")


def _gguf_model(b: Bottleneck) -> bool:
    return gguf_model_path(_label(b, "model")) is not None


def kv_quantization(b: Bottleneck) -> list[Step]:
    if NOT_FOR["kv_quantization"](b.engine):
        return []
    values = ["int8"] + (["fp8"] if b.device == "cuda" else [])
    if b.decode_verdict == "capacity-bound":
        return [Step({"kv_cache_dtype": v}, QUEUE_GAIN, "the KV cache caps the batch: half the bytes a token "
                                                        "holds about twice the sequences") for v in values]
    gain = b.decode_speedup(kv_ratio=0.5)
    return [Step({"kv_cache_dtype": v}, gain, f"KV is {100 * (1 - b.weight_share):.0f}% of a decode step's bytes: "
                                              f"halving it makes the step {gain:.2f}x as fast") for v in values]


def speculation(b: Bottleneck) -> list[Step]:
    if _label(b, "speculative_method", "none") != "none":
        return []
    if b.speculation == "off" or b.limiting_slo == "ttft":
        why = b.speculation_why if b.speculation == "off" else "TTFT breaks first: speculation speeds decode only"
        return [Step({"speculative_method": "ngram"}, None, why)]
    if b.speculation == "ngram":
        return [Step({"speculative_method": "ngram", "num_speculative_tokens": k}, SPECULATION_GAIN - (4 - k) / 20,
                     f"diagnose: {b.speculation_why}") for k in (4, 2)]
    return [Step({"speculative_model": "self:int4"}, SPECULATION_GAIN, f"diagnose: {b.speculation_why}")]


def batch_limits(b: Bottleneck, options: dict) -> list[Step]:
    seqs = EngineConfig(**{k: v for k, v in options.items() if k in ("max_num_seqs", "scheduler_policy")})
    cap = seqs.resolved_max_num_seqs()
    chunk = options.get("max_num_batched_tokens", EngineConfig.max_num_batched_tokens)
    steps = []
    if b.limiting_slo == "ttft" and b.concurrency >= 0.8 * cap:
        steps.append(Step({"max_num_seqs": cap * 2}, QUEUE_GAIN, f"~{b.concurrency:.0f} requests in flight fill "
                                                                  f"the cap of {cap} while TTFT breaks first: "
                                                                  "requests queue for a slot"))
    elif b.limiting_slo == "tpot" and b.decode_verdict == "compute-bound" and b.concurrency >= cap / 2 > 4:
        steps.append(Step({"max_num_seqs": cap // 2}, SCHEDULING_GAIN, "TPOT breaks first on compute-bound decode "
                                                                        "steps: a smaller batch keeps each step short"))
    else:
        steps.append(Step({"max_num_seqs": cap * 2}, None, f"~{b.concurrency:.1f} requests in flight: the cap of "
                                                           f"{cap} never bound"))
    if b.limiting_slo == "tpot" and b.mean_prompt_len >= 64 and chunk > 256:
        steps.append(Step({"max_num_batched_tokens": chunk // 2}, SCHEDULING_GAIN,
                          f"TPOT breaks first beside {b.mean_prompt_len:.0f}-token prompts: smaller prefill "
                          "chunks stall the decodes sharing their step less"))
    elif b.limiting_slo == "ttft" and b.mean_prompt_len > chunk / 4:
        steps.append(Step({"max_num_batched_tokens": chunk * 2}, SCHEDULING_GAIN,
                          f"TTFT breaks first: {b.mean_prompt_len:.0f}-token prompts fill steps of {chunk} tokens"))
    return steps


def scheduling(b: Bottleneck) -> list[Step]:
    steps = []
    if _label(b, "scheduler_policy") != "slo" and b.limiting_slo:
        steps.append(Step({"scheduler_policy": "slo"}, SLO_POLICY_GAIN,
                          "orders requests by slack to their TTFT / TPOT targets and caps prefill from the fitted "
                          "step time: goodput, where continuous batching serves throughput"))
    if _label(b, "enable_prefix_caching") == "False":
        steps.append(Step({"enable_prefix_caching": True}, QUEUE_GAIN if b.repeated_prefixes else None,
                          "the workload repeats prefixes" if b.repeated_prefixes else "no prompt shares a prefix"))
    if not NOT_FOR["cuda_graphs"](b.engine):
        steps.append(Step({"enforce_eager": False}, CUDA_GRAPHS_GAIN, "eager decode steps pay each kernel's launch"))
    if not NOT_FOR["async_scheduling"](b.engine):
        steps.append(Step({"async_scheduling": True}, SCHEDULING_GAIN, "the host prepares step N+1 while the "
                                                                       "device runs step N"))
    return steps


def parallelism(b: Bottleneck, options: dict) -> list[Step]:
    if NOT_FOR["tensor_parallel"](b.engine) or b.num_gpus < 2 or options.get("tensor_parallel_size", 1) > 1:
        return []
    if b.spec.num_heads % 2:
        return [Step({"tensor_parallel_size": 2}, None, f"{b.spec.num_heads} attention heads do not split in 2")]
    return [Step({"tensor_parallel_size": 2}, TP2_GAIN if b.limiting_slo != "ttft" else SCHEDULING_GAIN,
                 "each GPU reads half the weights a step, plus 2 all-reduces a layer; the cost per token "
                 "counts both GPUs")]


def candidate_steps(options: dict, b: Bottleneck) -> list[Step]:
    """Every step from `options` (the current best's engine options), applicable or not, in a fixed order."""
    return [*weight_quantization(b), *kv_quantization(b), *speculation(b), *batch_limits(b, options),
            *scheduling(b), *parallelism(b, options)]


def plan(options: dict, b: Bottleneck, tried: set[str]) -> tuple[list[tuple[Step, dict]], list[tuple[Step, str]]]:
    """(steps to try, best predicted first, each with the options it makes; steps skipped, with why)."""
    to_try, skipped = [], []
    for step in candidate_steps(options, b):
        after = {**options, **step.changes}
        if step.predicted is None:
            skipped.append((step, step.why))
        elif options_key(after) in tried:
            skipped.append((step, "measured already"))
        elif step.predicted < MIN_PREDICTED:
            skipped.append((step, f"predicted {step.predicted:.2f}x: {step.why}"))
        else:
            to_try.append((step, after))
    to_try.sort(key=lambda pair: -pair[0].predicted)  # stable: ties keep the rules' order
    return to_try, skipped
