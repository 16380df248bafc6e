"""Roofline arithmetic: FLOPs and bytes per phase, MFU/MBU, and what bounds each phase.

- FLOPs per token = 2 x matmul params + attention (4 x layers x context x q_size: QK^T and AV).
- A decode step reads every weight once (of an untied embedding table only a row a token: calc.py's
  decode_weight_bytes) plus each sequence's KV cache; a batch of B shares the weight read, so its
  arithmetic intensity is about B FLOPs per weight byte (x2 / bytes-per-weight).
  Pipeline micro-batches split a decode round (a token for every sequence) into steps that each read
  the weights (diagnose/parallel.py).
- Prefill of P tokens reuses each weight P times: intensity ~ P, far above the ridge point.
- MBU = bytes moved per step (the weights it reads, not all of them) / step time / peak bandwidth
  (the datasheet's, as MBU is usually defined: a step that reads at a copy's rate shows ~90% on an
  H100, never 100%); MFU = FLOP/s achieved / peak FLOP/s. The ridge point is the peaks' too.
- `dtype` sets bytes per weight; `compute_dtype` the peak FLOP/s and ridge (weight-only int8/int4
  multiply in the activations' dtype: float32 on a CPU engine, bf16 on a GPU). Default: from dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from goodserve.diagnose.calc import decode_weight_bytes, dtype_bytes, max_concurrent_sequences, weight_bytes
from goodserve.diagnose.observations import Observations
from goodserve.hardware import Hardware
from goodserve.model.spec import ModelSpec

# KV pool this full (or any preemption) means memory, not speed, caps the batch.
CAPACITY_KV_USAGE = 0.95


def attention_flops_per_token(spec: ModelSpec, context_len: float) -> float:
    return 4.0 * spec.num_layers * context_len * spec.q_size


def flops_per_token(spec: ModelSpec, context_len: float) -> float:
    return 2.0 * spec.num_matmul_params() + attention_flops_per_token(spec, context_len)


def prefill_flops(spec: ModelSpec, prompt_len: float) -> float:
    """Causal prefill: token i attends to i positions, so attention sums to 2 L q_size P (P + 1)."""
    return (2.0 * spec.num_matmul_params() * prompt_len
            + 2.0 * spec.num_layers * spec.q_size * prompt_len * (prompt_len + 1))


def decode_step_bytes(spec: ModelSpec, batch: float, context_len: float, dtype: str = "bf16",
                      kv_dtype: str = "bf16", weight_reads: int = 1) -> float:
    """Bytes a decode round reads: the weights once a step (weight_reads: its micro-batches; of a
    mixture of experts the routed experts only), plus every sequence's KV cache (a windowed layer's
    last window tokens only)."""
    return (weight_reads * decode_weight_bytes(spec, dtype, batch)
            + batch * spec.kv_bytes_per_sequence(context_len, dtype_bytes(kv_dtype)))


def mbu(bytes_per_step: float, steps_per_s: float, bandwidth: float) -> float:
    return bytes_per_step * steps_per_s / bandwidth


def mfu(flops_per_s: float, peak_flops: float) -> float:
    return flops_per_s / peak_flops


@dataclass
class PhaseAnalysis:
    phase: str  # "prefill" | "decode"
    flops_per_s: float
    bytes_per_s: float
    mfu: float
    mbu: float
    intensity: float  # FLOPs per byte moved
    ridge_point: float
    verdict: str  # "compute-bound" | "bandwidth-bound" | "capacity-bound" | "overhead-bound" (MFU far under)
    why: str


# Under this MFU a phase above the ridge is not compute-bound in fact: its time goes elsewhere.
MIN_COMPUTE_BOUND_MFU = 0.1


def _measured_bound(verdict: str, why: str, measured_mfu: float, elsewhere: str) -> tuple[str, str]:
    """The roofline's verdict, unless the measured MFU contradicts it: intensity above the ridge says
    compute could bound the phase, a few percent of the peak says it did not."""
    if verdict != "compute-bound" or measured_mfu >= MIN_COMPUTE_BOUND_MFU:
        return verdict, why
    return "overhead-bound", (f"{why}, but MFU is {100 * measured_mfu:.1f}%: the time goes to {elsewhere}, "
                              "not to compute")


def default_compute_dtype(dtype: str) -> str:
    return "bf16" if dtype in ("int8", "int4") else dtype


def analyze_decode(spec: ModelSpec, hw: Hardware, obs: Observations, dtype: str = "bf16",
                   kv_dtype: str = "bf16", compute_dtype: str | None = None, weight_reads: int = 1) -> PhaseAnalysis:
    """A round of TPOT: a token for every sequence in flight, in weight_reads micro-batches."""
    batch = max(1.0, obs.concurrency)
    context = obs.mean_context_len
    step_bytes = decode_step_bytes(spec, batch, context, dtype, kv_dtype, weight_reads)
    step_flops = batch * flops_per_token(spec, context)
    steps_per_s = 1.0 / obs.tpot_s if obs.tpot_s > 0 else 0.0
    compute_dtype = compute_dtype or default_compute_dtype(dtype)
    ridge = hw.ridge_point(compute_dtype)
    intensity = step_flops / step_bytes
    kv_budget = hw.memory_bytes * 0.9 - weight_bytes(spec, dtype)
    fits = max_concurrent_sequences(spec, kv_budget, int(obs.mean_prompt_len + obs.mean_output_len), kv_dtype)
    capacity = ((obs.num_preemptions or 0) > 0 or (obs.kv_cache_usage or 0.0) >= CAPACITY_KV_USAGE
                or fits < batch)
    if capacity:
        verdict = "capacity-bound"
        why = (f"the KV cache limits the batch (preemptions {obs.num_preemptions or 0:g}, "
               f"KV usage {100 * (obs.kv_cache_usage or 0):.0f}%, about {fits} sequences fit)")
    elif intensity >= ridge:
        verdict, why = "compute-bound", f"batch {batch:.1f} puts intensity {intensity:.0f} above the ridge {ridge:.0f}"
    else:
        verdict = "bandwidth-bound"
        steps = "each step reads" if weight_reads == 1 else f"{weight_reads} micro-batches (the weights each) read"
        why = (f"{steps} {step_bytes / 1e9:.2f} GB for {batch:.1f} tokens: intensity "
               f"{intensity:.1f} FLOP/B is below the ridge {ridge:.0f}")
    measured_mfu = mfu(step_flops * steps_per_s, hw.flops_for(compute_dtype))
    verdict, why = _measured_bound(verdict, why, measured_mfu, "host work and kernel launches between steps")
    return PhaseAnalysis("decode", step_flops * steps_per_s, step_bytes * steps_per_s, measured_mfu,
                         mbu(step_bytes, steps_per_s, hw.memory_bandwidth), intensity, ridge, verdict, why)


def analyze_prefill(spec: ModelSpec, hw: Hardware, obs: Observations, dtype: str = "bf16",
                    kv_dtype: str = "bf16", compute_dtype: str | None = None) -> PhaseAnalysis:
    """Per request from TTFT; TTFT includes queueing, so MFU and MBU here are lower bounds."""
    prompt = max(1.0, obs.mean_prompt_len)
    flops = prefill_flops(spec, prompt)
    # The weights a forward pass over the prompt's tokens reads, as a decode step of that many tokens.
    moved = decode_weight_bytes(spec, dtype, prompt) + prompt * spec.kv_bytes_per_token(dtype_bytes(kv_dtype))
    per_s = 1.0 / obs.ttft_s if obs.ttft_s > 0 else 0.0
    compute_dtype = compute_dtype or default_compute_dtype(dtype)
    ridge = hw.ridge_point(compute_dtype)
    intensity = flops / moved
    verdict = "compute-bound" if intensity >= ridge else "bandwidth-bound"
    why = (f"a {prompt:.0f}-token prompt does {intensity:.0f} FLOP per byte moved "
           f"({'above' if intensity >= ridge else 'below'} the ridge {ridge:.0f}); "
           f"MFU from TTFT, queueing included, so a lower bound")
    measured_mfu = mfu(flops * per_s, hw.flops_for(compute_dtype))
    verdict, why = _measured_bound(verdict, why, measured_mfu, "queueing (in TTFT) and host work")
    return PhaseAnalysis("prefill", flops * per_s, moved * per_s, measured_mfu,
                         mbu(moved, per_s, hw.memory_bandwidth), intensity, ridge, verdict, why)

