"""Prometheus metrics under vLLM's names with a `goodserve:` prefix, so vLLM dashboards port over.

Per-request histograms are observed when a request finishes, from the timestamps the engine
recorded on it. Engine-wide numbers (queue depths, KV usage, cache hits, step times) are read
from `engine.stats()` at scrape time by a collector, so they are never stale or double-counted.
Beyond vLLM: batch fill ratio, step time split by phase, SLO attainment (live goodput, only where
a target is set), the process's garbage-collector pauses, the cost per hour (--gpu-hourly-cost),
and the engine's resolved configuration as an info metric (`goodserve:engine_config_info`), which
`goodserve bench` records and `goodserve diagnose` reads.

vLLM's example Grafana dashboard and alerts also query names goodserve's own differ from; those are
exported too (VLLM_ALIASES below): the same observations under vLLM's name. deploy/monitoring/
holds goodserve's dashboard and alert rules.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from goodserve.engine.processes.gc_pauses import PAUSE_BUCKETS, watch_pauses
from goodserve.engine.core.stats import ITERATION_TOKEN_BUCKETS
from goodserve.outputs import RequestOutput

PREFIX = "goodserve:"
# vLLM's buckets: sub-second resolution for token latencies, minutes for whole requests.
TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                         1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                           20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True)
class Slo:
    """Latency targets a request must meet to count toward goodput; None: not checked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def any(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        ttft_ok = self.ttft_ms is None or (ttft_s is not None and ttft_s * 1000 <= self.ttft_ms)
        # A one-token answer has no time per output token, so it cannot miss that target.
        tpot_ok = self.tpot_ms is None or tpot_s is None or tpot_s * 1000 <= self.tpot_ms
        return ttft_ok and tpot_ok


def _since(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else max(0.0, end - start)


def time_per_output_token(out: RequestOutput) -> float | None:
    times = out.metrics.token_times
    if len(times) >= 2:
        return (times[-1] - times[0]) / (len(times) - 1)
    return None


def engine_info(engine) -> dict[str, str]:
    """What an AsyncEngine really runs (auto resolved: float32 and torch attention on a CPU), as strings."""
    import torch

    from goodserve.cpu_threads import available_cores
    from goodserve.engine.setup.kv_cache import kv_storage_dtype

    config, device = engine.config, engine.device  # resolved: no "auto" is left in it
    return {
        "model": config.model,
        "dtype": _dtype_name(engine.dtype),
        "quantization": config.quantization or "none",
        "kv_cache_dtype": _dtype_name(kv_storage_dtype(config, engine.dtype)),
        "device": device.type,
        "device_name": engine.info.device_name,
        "attention_backend": config.attention_backend,
        "scheduler_policy": config.scheduler_policy,
        "enable_chunked_prefill": str(config.enable_chunked_prefill),
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "cuda_graphs": str(engine.info.cuda_graphs),
        "async_scheduling": str(config.async_scheduling),
        "engine_process": str(engine.runs_in_own_process),
        "pipeline_micro_batches": str(engine.info.micro_batches),
        "max_num_seqs": str(config.max_num_seqs),
        "max_num_batched_tokens": str(config.max_num_batched_tokens),
        "speculative_method": config.speculative_method or "none",
        "speculative_model": config.speculative_model or "none",
        # what diagnose weighs CPU oversubscription by: the cores the server may use, and the threads
        # of the engine (each rank) and of the server's own pool where the engine has its own process
        "cpu_cores": str(available_cores().count),
        "cpu_threads": str(engine.info.cpu_threads),
        "server_cpu_threads": str(torch.get_num_threads() if engine.runs_in_own_process else 0),
        "world_size": str(config.world_size),
    }


def cache_info(engine) -> dict[str, str]:
    """vLLM's cache_config_info labels, from the engine's resolved pool."""
    from goodserve.engine.setup.kv_cache import kv_storage_dtype

    config = engine.config
    return {"block_size": str(config.block_size), "num_gpu_blocks": str(config.num_kv_blocks),
            "cache_dtype": _dtype_name(kv_storage_dtype(config, engine.dtype)),
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "gpu_memory_utilization": str(config.gpu_memory_utilization)}


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


class EngineStatsCollector:
    """Reads the engine's counters and gauges at scrape time."""

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.config = engine.config

    def _gauge(self, name: str, doc: str, value: float, **labels: str) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name", *labels])
        family.add_metric([self.model_name, *labels.values()], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def _spec_decode(self, s) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters; acceptance rate (accepted / draft tokens), mean
        acceptance length (1 + accepted / drafts) and per-position rates (per_pos / drafts) derive
        from them over any window (bench/spec_decode.py)."""
        yield self._counter("spec_decode_num_drafts", "Verifications: a sequence's proposals checked in a step.",
                            s.spec_decode_num_drafts)
        yield self._counter("spec_decode_num_draft_tokens", "Speculative tokens proposed and verified.",
                            s.spec_decode_num_draft_tokens)
        yield self._counter("spec_decode_num_accepted_tokens", "Speculative tokens the target model kept.",
                            s.spec_decode_num_accepted_tokens)
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Verifications that kept the proposed token at each position (0-based).",
                                      labels=["model_name", "position"])
        for position, count in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            per_pos.add_metric([self.model_name, str(position)], count)
        yield per_pos

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        yield self._gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", s.kv_cache_usage)
        yield self._gauge("gpu_cache_usage_perc", "kv_cache_usage_perc, under vLLM's earlier name.", s.kv_cache_usage)
        yield self._gauge("num_kv_blocks", "KV cache blocks in the pool.", s.num_kv_blocks)
        yield self._gauge("num_used_kv_blocks", "KV cache blocks held by requests.", s.num_used_kv_blocks)
        yield self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            s.prefix_cache_queries)
        yield self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield self._counter("num_preemptions", "Requests preempted to free KV cache.", s.num_preemptions)
        yield self._counter("engine_steps", "Engine steps run.", s.num_steps)
        yield self._gauge("step_time_prediction_error",
                          "The step-time model's mean relative error, |measured - predicted| / predicted (EWMA).",
                          s.step_time_relative_error)
        if self.config.speculative_method:
            yield from self._spec_decode(s)
        fill = GaugeMetricFamily(
            PREFIX + "batch_fill_ratio",
            "Last step's batch over its limit: tokens / max_num_batched_tokens, seqs / max_num_seqs.",
            labels=["model_name", "dimension"],
        )
        fill.add_metric([self.model_name, "tokens"], s.last_batch_tokens / self.config.max_num_batched_tokens)
        fill.add_metric([self.model_name, "seqs"], s.last_batch_seqs / self.config.max_num_seqs)
        yield fill
        split = CounterMetricFamily(
            PREFIX + "step_time_seconds", "Engine step time by phase.", labels=["model_name", "phase"]
        )
        for phase in ("schedule", "prepare", "forward", "sample", "detokenize", "output"):
            split.add_metric([self.model_name, phase], getattr(s, f"{phase}_seconds_total"))
        yield split
        yield self._iteration_tokens(s)

    def _iteration_tokens(self, s) -> Metric:
        """vLLM's iteration_tokens_total: tokens per engine step, as a histogram."""
        family = HistogramMetricFamily(PREFIX + "iteration_tokens_total", "Tokens per engine step.",
                                       labels=["model_name"])
        cumulative = list(itertools.accumulate(s.step_tokens_counts or [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)))
        buckets = [(f"{le:g}", n) for le, n in zip(ITERATION_TOKEN_BUCKETS, cumulative)] + [("+Inf", cumulative[-1])]
        family.add_metric([self.model_name], buckets, s.step_tokens_total)
        return family


class PrefillStatsCollector(EngineStatsCollector):
    """--disaggregate: the prefill engine's pool and queue, as its process last reported them."""

    def collect(self) -> Iterator[Metric]:
        s = self.engine.prefill_stats()
        yield self._gauge("prefill_num_kv_blocks", "The prefill engine's KV cache blocks.", s.num_kv_blocks)
        yield self._gauge("prefill_num_used_kv_blocks", "The prefill engine's KV blocks held by requests.",
                          s.num_used_kv_blocks)
        yield self._gauge("prefill_num_requests_running", "Requests the prefill engine is running.", s.num_running)
        yield self._gauge("prefill_num_requests_waiting", "Requests waiting in the prefill engine.", s.num_waiting)


class GcPauseCollector:
    """The garbage-collector pauses (engine/processes/gc_pauses.py) of the server's process and, where the engine
    runs in one of its own, of that one: each pause there stops the engine's steps, and every stream's
    next token with them."""

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.pauses = watch_pauses()

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(PREFIX + "gc_pause_seconds",
                                       "Garbage collections by process (server, engine) and generation (2: full).",
                                       labels=["model_name", "process", "generation"])
        logs = {"server": self.pauses, "engine": self.engine.gc_pauses()}
        for process, log in logs.items():
            for generation, counts in enumerate(log.bucket_counts if log is not None else ()):
                cumulative = list(itertools.accumulate(counts))
                buckets = [(f"{le:g}", n) for le, n in zip(PAUSE_BUCKETS, cumulative)] + [("+Inf", cumulative[-1])]
                family.add_metric([self.model_name, process, str(generation)], buckets, log.seconds[generation])
        yield family


def one_two_five_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's buckets for request lengths)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class ServerMetrics:
    def __init__(self, engine, model_name: str, slo: Slo, gpu_hourly_cost: float | None = None):
        # A registry per server, not the process-global one, so several servers can share a process.
        self.registry = CollectorRegistry()
        self.slo = slo
        self.model_name = model_name
        self.registry.register(EngineStatsCollector(engine, model_name))
        self.registry.register(GcPauseCollector(engine, model_name))
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        if engine.prefill_stats() is not None:
            self.registry.register(PrefillStatsCollector(engine, model_name))
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        def counter(name: str, doc: str, extra_labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra_labels], registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TOKEN_LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.", TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds", "Mean time per output token, per request.",
                              TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                 REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "First token to finish.", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("request_inference_time_seconds", "First scheduled to finish (prefill + decode).",
                                   REQUEST_LATENCY_BUCKETS)
        length_buckets = one_two_five_buckets(engine.max_model_len)
        self.prompt_lengths = histogram("request_prompt_tokens", "Prompt tokens, per finished request.",
                                        length_buckets)
        self.generation_lengths = histogram("request_generation_tokens", "Generated tokens, per finished request "
                                            "(all its choices).", length_buckets)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        self.request_success = counter("request_success", "Finished requests by finish reason.",
                                       ("finished_reason",))
        self.request_slo = counter("request_slo", "Finished requests that met (or missed) the SLO.", ("attained",))
        self.request_rejected = counter("request_rejected", "Requests refused before reaching the engine.",
                                        ("status",))
        self.batch_lines = counter("batch_lines", "Batch API lines answered (succeeded: status 200).", ("status",))
        # vLLM's names where goodserve's differ: time_per_output_token_seconds is its per-token gap
        # histogram (inter_token_latency_seconds here); request_params_n, the samples a request asked for;
        # request_max_num_generation_tokens, a request's longest choice.
        self.tpot_vllm = histogram("time_per_output_token_seconds", "inter_token_latency_seconds, under vLLM's "
                                   "earlier name.", TOKEN_LATENCY_BUCKETS)
        self.params_n = histogram("request_params_n", "Choices (n) per finished request.", (1, 2, 5, 10, 20))
        self.max_generation = histogram("request_max_num_generation_tokens", "The longest choice's generated "
                                        "tokens, per finished request.", length_buckets)
        Info(PREFIX + "engine_config", "The engine's resolved configuration.", labels,
             registry=self.registry).labels(model_name).info(engine_info(engine))
        Info(PREFIX + "cache_config", "The KV cache's configuration (vLLM's cache_config_info).", labels,
             registry=self.registry).labels(model_name).info(cache_info(engine))
        if gpu_hourly_cost is not None:
            Gauge(PREFIX + "cost_per_hour_dollars", "--gpu-hourly-cost times the GPUs the engine runs on.", labels,
                  registry=self.registry).labels(model_name).set(gpu_hourly_cost * engine.config.world_size)

    def observe_finished(self, out: RequestOutput, targets: Slo | None = None) -> None:
        """targets: the request's own SLO (slo_ttft_ms / slo_tpot_ms), where it set them; else the server's."""
        m = out.metrics
        finished = m.finished_time or time.time()
        ttft = _since(m.arrival_time, m.first_token_time)
        tpot = time_per_output_token(out)
        name = self.model_name
        for hist, value in [
            (self.e2e, _since(m.arrival_time, finished)),
            (self.queue, _since(m.arrival_time, m.first_scheduled_time)),
            (self.ttft, ttft),
            (self.prefill, _since(m.first_scheduled_time, m.first_token_time)),
            (self.decode, _since(m.first_token_time, finished)),
            (self.inference, _since(m.first_scheduled_time, finished)),
            (self.tpot, tpot),
        ]:
            if value is not None:
                hist.labels(name).observe(value)
        for earlier, later in zip(m.token_times, m.token_times[1:]):
            self.itl.labels(name).observe(max(0.0, later - earlier))
            self.tpot_vllm.labels(name).observe(max(0.0, later - earlier))
        prompt, generated = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
        self.prompt_tokens.labels(name).inc(prompt)
        self.generation_tokens.labels(name).inc(generated)
        self.prompt_lengths.labels(name).observe(prompt)
        self.generation_lengths.labels(name).observe(generated)
        self.params_n.labels(name).observe(len(out.outputs))
        self.max_generation.labels(name).observe(max(len(c.token_ids) for c in out.outputs))
        self.request_success.labels(name, out.outputs[0].finish_reason or "abort").inc()
        slo = self.slo if targets is None else Slo(
            self.slo.ttft_ms if targets.ttft_ms is None else targets.ttft_ms,
            self.slo.tpot_ms if targets.tpot_ms is None else targets.tpot_ms)
        if slo.any:  # no target, no attainment: a request without one neither met nor missed it
            self.request_slo.labels(name, str(slo.met(ttft, tpot)).lower()).inc()

    def observe_aborted(self) -> None:
        self.request_success.labels(self.model_name, "abort").inc()

    def observe_rejected(self, status: int) -> None:
        self.request_rejected.labels(self.model_name, str(status)).inc()

    def observe_batch_line(self, ok: bool) -> None:
        self.batch_lines.labels(self.model_name, "succeeded" if ok else "failed").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
