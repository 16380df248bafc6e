"""What limits a measured configuration, in the terms tune's moves need: diagnose's roofline and
advice read from the trial's own probes (no engine runs here, so a resumed tune re-derives it).

The probe at capacity (the best passing one) is the run diagnose reads: concurrency, lengths,
decode verdict. The first probe above it says which target broke first: the SLO whose p90 is
furthest over its limit there is the one a move must relieve.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from goodserve.diagnose.advisor import advise
from goodserve.diagnose.assumptions import resolve
from goodserve.diagnose.calc import QUANTIZED_WEIGHT_DTYPES, decode_weight_bytes
from goodserve.diagnose.model_shape import resolve_spec
from goodserve.diagnose.observations import from_bench_run
from goodserve.diagnose.roofline import analyze_decode, analyze_prefill, decode_step_bytes
from goodserve.diagnose.speculation import recommend_speculation
from goodserve.hardware import HARDWARE, get_hardware, hardware_for_device
from goodserve.model.gguf_reader import open_gguf
from goodserve.model.spec import ModelSpec
from goodserve.model_names import gguf_model_path

SLO_PERCENTILE = 90  # attainment is judged at 90%: the p90 is the request that decides a probe


@dataclass
class Bottleneck:
    device: str  # "cpu" | "cuda"
    num_gpus: int  # GPUs this machine has (tensor parallelism needs 2+)
    limiting_slo: str | None  # "ttft" | "tpot": the target the probe above capacity missed most; None: unknown
    decode_verdict: str  # diagnose's roofline: bandwidth-bound | compute-bound | capacity-bound
    concurrency: float  # requests in flight at capacity
    mean_prompt_len: float
    mean_output_len: float
    weight_share: float  # of a decode step's bytes, the weights' (the rest is KV)
    speculation: str  # diagnose's pick: ngram | self:int4 | off
    speculation_why: str
    repeated_prefixes: bool
    engine: dict[str, str]  # the engine's configuration labels (engine_config_info)
    spec: ModelSpec = field(repr=False)
    symptoms: list[str] = field(default_factory=list)  # diagnose's advice, worst first

    def summary(self) -> str:
        limit = f"{self.limiting_slo.upper()} breaks first" if self.limiting_slo else "no probe failed"
        return (f"{limit}; decode {self.decode_verdict} at ~{self.concurrency:.1f} requests in flight, weights "
                f"{100 * self.weight_share:.0f}% of a decode step's bytes"
                + (f"; diagnose: {', '.join(self.symptoms)}" if self.symptoms else ""))

    def read_bytes_of(self, quantization: str) -> float:
        """Bytes of the weights a decode step at capacity reads under a quantization (diagnose's count:
        an untied embedding table is left out, a token reads one row of it); a GGUF file's by its size."""
        path = gguf_model_path(self.engine.get("model", ""))
        if quantization == "gguf" and path is not None:
            return float(os.path.getsize(path)) - (0.0 if self.spec.tie_word_embeddings else _table_bytes(path))
        short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[self.engine.get("dtype", "float32")]
        return decode_weight_bytes(self.spec, quantization if quantization in QUANTIZED_WEIGHT_DTYPES else short,
                                   max(1.0, self.concurrency))

    @property
    def fp8_tensor_cores(self) -> bool:
        """Whether the GPU the trial ran on has FP8 tensor cores (its hardware table entry lists fp8)."""
        key = hardware_for_device(self.device, self.engine.get("device_name", ""))
        return self.device == "cuda" and key is not None and "fp8" in HARDWARE[key].peak_flops

    def decode_speedup(self, weight_ratio: float = 1.0, kv_ratio: float = 1.0) -> float:
        """How much faster a bandwidth-bound decode step gets with the weights' and KV's bytes scaled."""
        return 1.0 / (self.weight_share * weight_ratio + (1.0 - self.weight_share) * kv_ratio)


def limiting_slo(run: dict | None, slos_ms: dict[str, float]) -> str | None:
    """The target whose p90 is furthest over its limit in the run (a failing probe)."""
    if not run:
        return None
    over = {name: run.get(f"p{SLO_PERCENTILE}_{name}_ms", 0.0) / limit for name, limit in slos_ms.items()}
    return max(over, key=over.get) if over else None


def diagnose_trial(trial: dict, slos_ms: dict[str, float], num_gpus: int) -> Bottleneck:
    """trial: a measured trial (measure.py) with its engine labels and probes at and above capacity."""
    engine = trial["engine"]
    run = trial["at_capacity"]
    obs = from_bench_run(run, f"trial {trial['move']}", engine)
    assumed = resolve({"model": None, "hardware": None, "dtype": None, "kv_cache_dtype": None,
                       "pipeline_micro_batches": None}, engine, f"trial {trial['move']}")
    spec = resolve_spec(assumed.model)
    hardware = get_hardware(assumed.hardware)
    decode = analyze_decode(spec, hardware, obs, assumed.weight_dtype, assumed.kv_dtype, assumed.compute_dtype)
    prefill = analyze_prefill(spec, hardware, obs, assumed.weight_dtype, assumed.kv_dtype, assumed.compute_dtype)
    batch = max(1.0, obs.concurrency)
    step = decode_step_bytes(spec, batch, obs.mean_context_len, assumed.weight_dtype, assumed.kv_dtype)
    speculation = recommend_speculation(obs)
    return Bottleneck(
        device=engine.get("device", "cpu"), num_gpus=num_gpus,
        limiting_slo=limiting_slo(trial.get("above_capacity"), slos_ms), decode_verdict=decode.verdict,
        concurrency=obs.concurrency, mean_prompt_len=obs.mean_prompt_len, mean_output_len=obs.mean_output_len,
        weight_share=decode_weight_bytes(spec, assumed.weight_dtype, batch) / step, speculation=speculation.method,
        speculation_why=speculation.why, repeated_prefixes=obs.repeated_prefixes or _repeats(run),
        engine=engine, spec=spec, symptoms=[a.symptom for a in advise(obs, [decode, prefill], engine)])


def _table_bytes(path) -> float:
    """The GGUF file's token embedding table, in its own encoding."""
    return float(next(t.n_bytes for t in open_gguf(path).tensors if t.name == "token_embd.weight"))


def _repeats(run: dict) -> bool:
    """Prompts that hit the prefix cache: the workload shares prefixes (a recording, a dataset file)."""
    return (run.get("cached_prompt_share") or 0.0) > 0.1

