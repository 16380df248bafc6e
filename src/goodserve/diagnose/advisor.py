"""From measured symptoms to ranked fixes: each names the goodserve option that applies it, the
effect to expect, and the measurement that would confirm it worked.

Each rule returns a severity (bigger = worse, None = symptom absent); advice is sorted by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from goodserve.diagnose.observations import Observations
from goodserve.diagnose.roofline import PhaseAnalysis

# Thresholds that make a symptom, absent SLOs to compare against.
HIGH_TTFT_S = 1.0
HIGH_TPOT_S = 0.1
LOW_MBU = 0.3
LOW_PREFIX_HIT_RATE = 0.3
LONG_CONTEXT_TOKENS = 4096
# Past this share of the engine's step time on host work, the device waits on the host: in full
# without async scheduling, and with it once the host's part outlasts the device's.
HIGH_HOST_SHARE = 0.3
# Replicas on one CPU share its cores: they add no compute there (NOT_FOR["replicas"]).
REPLICAS = "--data-parallel-size 2 (or more: replicas behind the router; goodserve router across hosts)"


@dataclass(frozen=True)
class Fix:
    option: str  # the goodserve flag that applies it
    effect: str  # what to expect
    confirm: str  # what to measure to see it worked
    turns_on: str = ""  # the engine feature it applies, checked against the engine's config (NOT_FOR)


@dataclass
class Advice:
    symptom: str
    severity: float
    evidence: str
    fixes: list[Fix]


@dataclass(frozen=True)
class Rule:
    symptom: str
    severity: Callable[[Observations, dict[str, PhaseAnalysis]], float | None]
    evidence: Callable[[Observations, dict[str, PhaseAnalysis]], str]
    fixes: tuple[Fix, ...]


def _over(value: float | None, limit: float | None) -> float | None:
    """How far over its limit a value is (1.0 = 2x the limit); None when within it."""
    if value is None or not limit or value <= limit:
        return None
    return value / limit - 1.0


def _slo_s(obs: Observations, name: str, default_s: float) -> float:
    slo_ms = (obs.slos_ms or {}).get(name)
    return slo_ms / 1000 if slo_ms else default_s


def _high_ttft(obs, phases):
    return _over(obs.ttft_p99_s or obs.ttft_s, _slo_s(obs, "ttft", HIGH_TTFT_S))


def _high_tpot(obs, phases):
    return _over(obs.tpot_p99_s or obs.tpot_s, _slo_s(obs, "tpot", HIGH_TPOT_S))


def _low_mbu(obs, phases):
    decode = phases["decode"]
    # Host-bound steps explain a low MBU themselves, and their cure is not a bigger batch: on an H200
    # the server's output fell from 9.4 K to 7.1 K tok/s going from 64 to 512 streams (BENCHMARKS.md).
    if decode.verdict != "bandwidth-bound" or decode.mbu >= LOW_MBU or _host_bound(obs, phases) is not None:
        return None
    return (LOW_MBU - decode.mbu) / LOW_MBU


def _memory_pressure(obs, phases):
    if (obs.num_preemptions or 0) > 0:
        return 1.0 + min(obs.num_preemptions, 100) / 100
    return 0.5 if phases["decode"].verdict == "capacity-bound" else None


def _low_prefix_hits(obs, phases):
    if not obs.repeated_prefixes or obs.prefix_cache_hit_rate is None:
        return None
    return _over(LOW_PREFIX_HIT_RATE, obs.prefix_cache_hit_rate or 1e-9)


def _long_context(obs, phases):
    return _over(obs.mean_prompt_len, LONG_CONTEXT_TOKENS)


def _host_bound(obs, phases):
    return _over(obs.host_share, HIGH_HOST_SHARE)


def _host_evidence(obs: Observations, mbu: float) -> str:
    shares = obs.step_phase_shares
    largest = sorted((p for p in shares if p != "forward"), key=shares.get, reverse=True)[:2]
    gc = f", garbage-collector pauses {100 * obs.gc_pause_share:.1f}% of the wall time" \
        if obs.gc_pause_share is not None else ""
    return (f"{100 * obs.host_share:.0f}% of the engine's step time is host work outside the forward pass ("
            + ", ".join(f"{p} {100 * shares[p]:.0f}%" for p in largest) + f"){gc}, decode MBU {100 * mbu:.0f}%")


def _on_cpu(engine: dict[str, str]) -> bool:
    return engine.get("device") == "cpu"


def _is_on(engine: dict[str, str], key: str) -> bool:
    return engine.get(key) == "True"


def _quantized(engine: dict[str, str]) -> bool:
    return engine.get("quantization", "none") != "none"


# Fix.turns_on -> whether an engine (its engine_config_info labels) has it on already or cannot have it.
NOT_FOR: dict[str, Callable[[dict[str, str]], bool]] = {
    "kv_quantization": lambda e: e.get("kv_cache_dtype") in ("int8", "float8_e4m3fn"),
    "weight_quantization": _quantized,
    "gpu_memory": _on_cpu,
    "cpu_memory": lambda e: not _on_cpu(e),
    "chunked_prefill": lambda e: _is_on(e, "enable_chunked_prefill"),
    "prefix_caching": lambda e: _is_on(e, "enable_prefix_caching"),
    "gpu_quantization_speed": lambda e: _on_cpu(e) or _quantized(e),
    "cpu_quantization_speed": lambda e: not _on_cpu(e) or e.get("quantization") in ("int4", "gguf"),
    "cuda_graphs": lambda e: _on_cpu(e) or _is_on(e, "cuda_graphs"),
    "cuda_graphs_and_triton": lambda e: _on_cpu(e) or (_is_on(e, "cuda_graphs")
                                                       and e.get("attention_backend") == "triton"),
    "continuous_batching": lambda e: e.get("scheduler_policy") == "continuous",
    "tensor_parallel": _on_cpu,  # gloo's all-reduces cost more than a CPU's decode step saves
    "replicas": _on_cpu,  # replicas on one CPU split its cores, not add to them
    "engine_process": lambda e: _is_on(e, "engine_process"),
    # async scheduling needs CUDA graphs (engine/setup/config_resolution.py)
    "async_scheduling": lambda e: _on_cpu(e) or _is_on(e, "async_scheduling") or not _is_on(e, "cuda_graphs"),
}

RULES: tuple[Rule, ...] = (
    Rule("preemptions / KV cache full", _memory_pressure,
         lambda o, p: f"{o.num_preemptions or 0:g} preemptions, KV usage {100 * (o.kv_cache_usage or 0):.0f}%, "
                      f"decode verdict {p['decode'].verdict}",
         (Fix("--kv-cache-dtype int8 (or fp8)", "about 2x the sequences in the same KV memory",
              "num_preemptions stays 0 and kv_cache_usage_perc drops at the same load", "kv_quantization"),
          Fix("--quantization int8", "weights shrink ~2x; the freed memory becomes KV blocks",
              "num_kv_blocks in the startup log rises", "weight_quantization"),
          Fix("--gpu-memory-utilization 0.95", "a few percent more KV blocks",
              "num_kv_blocks rises; no CUDA OOM under load", "gpu_memory"),
          Fix("--cpu-kv-cache-bytes (higher)", "a bigger KV pool in host memory",
              "num_kv_blocks rises; num_preemptions falls", "cpu_memory"),
          Fix("--max-num-seqs (lower)", "fewer concurrent sequences, no recompute thrash",
              "num_preemptions 0; p99 TPOT steadier"))),
    Rule("high TTFT", _high_ttft,
         lambda o, p: f"TTFT {1000 * (o.ttft_p99_s or o.ttft_s):.0f} ms (p99 where known)"
                      + (f", {o.num_waiting:g} waiting" if o.num_waiting is not None else ""),
         (Fix("--enable-chunked-prefill --max-num-batched-tokens 4096",
              "long prompts no longer block the queue; prefills share steps with decodes (2048 to 8192 tokens a "
              "step: more for throughput, fewer for inter-token latency)",
              "p99 TTFT and request_queue_time_seconds fall at the same request rate", "chunked_prefill"),
          Fix("--enable-prefix-caching", "repeated prefixes skip prefill entirely",
              "prefix_cache_hits / prefix_cache_queries rises; TTFT falls for repeated prompts", "prefix_caching"),
          Fix("--max-waiting (about what the TTFT target lets queue: admission control)",
              "overload turns into fast 429s instead of minutes of queueing",
              "goodserve bench --goodput ttft:MS: SLO attainment of admitted requests"),
          Fix(REPLICAS,
              "R engines share the arrivals: about R x the request rate at the same TTFT",
              "goodserve bench --goodput-capacity: the capacity rises about R x", "replicas"))),
    Rule("high TPOT", _high_tpot,
         lambda o, p: f"TPOT {1000 * (o.tpot_p99_s or o.tpot_s):.1f} ms (p99 where known), "
                      f"decode {p['decode'].verdict}, MBU {100 * p['decode'].mbu:.0f}%",
         (Fix("--quantization int8 (or int4)", "decode reads 2x (4x) fewer weight bytes per step",
              "median TPOT falls; goodserve diagnose shows the same MBU at lower TPOT", "gpu_quantization_speed"),
          # On a CPU int8 decode measured slower than float32 (10.2 vs 14.2 tok/s, one thread): only
          # the 4-bit paths, which have native kernels, buy speed there.
          Fix("--quantization gguf (a GGUF model's own codes) or int4",
              "native 4-bit kernels read far fewer weight bytes per step than float32 (int8 is slower on a CPU)",
              "median TPOT falls; goodserve generate's summary shows tok/s", "cpu_quantization_speed"),
          Fix("--max-num-batched-tokens (lower)", "smaller prefill chunks stall decodes less",
              "p99 ITL falls while median ITL stays"),
          Fix("--no-enforce-eager (CUDA graphs)", "removes per-kernel launch overhead from small batches",
              "step_time_seconds{phase=forward} per step falls", "cuda_graphs"),
          # 2 all-reduces a layer (~12.5 us each in a step on H100s) and each layer's fixed latencies take
          # much of the gain at batch 1: TP 2 measured 1.40x, TP 4 2.06x on H100s (diagnose/parallel.py).
          Fix("--tensor-parallel-size 2 (or 4, 8)",
              "each GPU reads 1 / N of the weights a step, plus 2 all-reduces a layer: `goodserve calc fit --tp N` "
              "prints the TPOT to expect with them",
              "median TPOT falls at the same load; goodserve diagnose --tp N shows MBU over the N GPUs",
              "tensor_parallel"))),
    Rule("low throughput at low MBU", _low_mbu,
         lambda o, p: f"decode MBU {100 * p['decode'].mbu:.0f}% with ~{o.concurrency:.1f} requests in flight",
         (Fix("--max-num-seqs (higher, with more client concurrency)",
              "bigger decode batches share each weight read: throughput rises almost linearly",
              "output_throughput rises and MBU climbs toward 60-80% in goodserve diagnose"),
          Fix("--no-enforce-eager --attention-backend triton (CUDA graphs and the Triton kernels)",
              "less per-step overhead, so steps approach the bandwidth limit",
              "goodserve:step_time_seconds split: forward share of step time rises", "cuda_graphs_and_triton"),
          Fix("--scheduler-policy continuous", "new requests join the running batch every step",
              "batch_fill_ratio{dimension=seqs} rises", "continuous_batching"),
          Fix("--scheduler-policy makespan (offline batches of known lengths, ignore_eos)",
              "the longest answers' tail of nearly empty steps carries the rest of the batch",
              "the batch's wall time falls; 5% on an 8B model's ShareGPT-like batch (benchmarks/BENCHMARKS.md)"))),
    Rule("low prefix-cache hit rate on repeated prefixes", _low_prefix_hits,
         lambda o, p: f"{100 * (o.prefix_cache_hit_rate or 0):.0f}% of prompt tokens hit the cache "
                      f"though the workload repeats prefixes",
         (Fix("--enable-prefix-caching", "shared prefixes are computed once",
              "prefix_cache_hits / prefix_cache_queries approaches the shared fraction of each prompt",
              "prefix_caching"),
          Fix("--block-size 16 (smaller)", "only full blocks are cached; smaller blocks cache more of a prefix",
              "hit rate rises for prefixes that are not block-aligned"),
          Fix("--gpu-memory-utilization or --num-kv-blocks (higher)",
              "a bigger pool evicts cached prefixes later", "hit rate holds as the number of prefixes grows"))),
    Rule("host-bound steps", _host_bound,
         lambda o, p: _host_evidence(o, p["decode"].mbu),
         (Fix("--async-scheduling", "the host prepares and launches step N+1 while the device runs step N, "
              "so the host's part is hidden up to the device's", "TPOT falls at the same load", "async_scheduling"),
          Fix("the engine in its own process (serve's default: drop --no-engine-process)",
              "the engine's steps and the HTTP event loop no longer take turns on one Python process's GIL",
              "goodserve bench: output tok/s rises at many streams (1.7x at 256 on an H200)", "engine_process"),
          Fix(REPLICAS,
              "each replica's engine runs in its own process with its own host thread, so the host work "
              "is split R ways", "goodserve bench --goodput-capacity rises about R x (2 replicas on 2 H200s "
              "completed 2.02x one at saturation: benchmarks/BENCHMARKS.md)", "replicas"),
          Fix("(the host) a CPU with faster cores, and nothing else on the server's cores",
              "the engine's step loop is one Python thread, so one core's speed bounds how fast host-bound "
              "steps follow each other", "goodserve diagnose --metrics-url: the host share of step time falls"))),
    Rule("long contexts", _long_context,
         lambda o, p: f"mean prompt {o.mean_prompt_len:.0f} tokens",
         (Fix("--kv-cache-dtype int8", "halves the KV read that dominates long-context decode steps",
              "TPOT falls more at long contexts than short ones", "kv_quantization"),
          Fix("--enable-chunked-prefill", "a long prefill is split so decodes keep flowing",
              "p99 ITL stays flat while long prompts arrive", "chunked_prefill"),
          Fix("--max-model-len (lower, if the workload allows)", "reserves fewer blocks per request",
              "more concurrent sequences; num_preemptions falls"))),
)


def applicable(fixes: tuple[Fix, ...], engine: dict[str, str] | None) -> list[Fix]:
    """The fixes the engine has not applied already and its hardware can apply (all: engine unknown)."""
    if not engine:
        return list(fixes)
    return [fix for fix in fixes if not (fix.turns_on and NOT_FOR[fix.turns_on](engine))]


def oversubscribed(engine: dict[str, str] | None) -> Advice | None:
    """More compute threads than usable cores on a CPU engine (its engine_config_info's cpu_* labels):
    the OpenMP pools wait on each other's cores, and step times swing run to run."""
    if not engine or not _on_cpu(engine) or "cpu_cores" not in engine:
        return None
    cores, ranks = int(engine["cpu_cores"]), int(engine.get("world_size", "1"))
    engine_threads, server_threads = int(engine["cpu_threads"]), int(engine.get("server_cpu_threads", "0"))
    threads = engine_threads * ranks + server_threads
    if threads <= cores:
        return None
    fitting = max(1, (cores - 1) // ranks)
    return Advice(
        "CPU oversubscribed", threads / cores - 1.0,
        f"{threads} compute threads ({engine_threads} per engine rank x {ranks}, {server_threads} in the server's "
        f"process) on {cores} usable cores",
        [Fix(f"OMP_NUM_THREADS={fitting} (or unset it: goodserve serve picks the threads from the usable cores)",
             "each thread keeps a core; the server's event loop keeps one of its own",
             "the serve log's 'CPU threads' line; TPOT steadier from run to run in goodserve bench")])


def advise(obs: Observations, phases: list[PhaseAnalysis], engine: dict[str, str] | None = None) -> list[Advice]:
    """engine: the run's engine_config_info labels, so no fix repeats what is on or what the hardware lacks."""
    by_phase = {p.phase: p for p in phases}
    advice = [found for found in (oversubscribed(engine),) if found is not None]
    for rule in RULES:
        severity = rule.severity(obs, by_phase)
        if severity is not None:
            advice.append(Advice(rule.symptom, severity, rule.evidence(obs, by_phase),
                                 applicable(rule.fixes, engine)))
    return sorted(advice, key=lambda a: -a.severity)
