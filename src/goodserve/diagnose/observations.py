"""What was measured, from a bench result JSON or from two scrapes of a live server's /metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx2
from prometheus_client.parser import text_string_to_metric_families

from goodserve.bench.engine_config import fetch_engine_config
from goodserve.bench.result import load_json, records_of, runs_of
from goodserve.errors import InvalidRequestError

PREFIX = "goodserve:"
# Labels whose values scrape() keeps apart (as name{label=value}) beside the sum over all labels.
SPLIT_LABELS = ("phase", "generation")
STEP_PHASES = ("schedule", "prepare", "forward", "sample", "detokenize", "output")


@dataclass
class Observations:
    source: str
    mean_prompt_len: float
    mean_output_len: float
    concurrency: float  # mean requests in flight (Little's law: sum of latencies / wall time)
    ttft_s: float  # typical (median from bench, mean from /metrics)
    tpot_s: float
    input_throughput: float  # tokens/s
    output_throughput: float
    request_throughput: float
    ttft_p99_s: float | None = None
    tpot_p99_s: float | None = None
    error_rate: float = 0.0
    num_preemptions: float | None = None
    kv_cache_usage: float | None = None  # 0..1
    num_waiting: float | None = None
    prefix_cache_hit_rate: float | None = None  # 0..1 of prompt tokens
    repeated_prefixes: bool = False  # the workload repeats prefixes (so the cache should hit)
    slos_ms: dict | None = None
    slo_attainment: float | None = None  # percent
    engine: dict | None = None  # the server's engine_config_info labels, when the source recorded them
    # Speculative decoding (diagnose/speculation.py): the share of output words prompt lookup would
    # predict (bench results only), and the measured acceptance (0..1) where the server speculated.
    prompt_lookup_overlap: float | None = None
    spec_acceptance_rate: float | None = None
    # The engine thread's step time by phase (0..1 each; /metrics only), and the garbage collector's
    # pauses as a share of the wall time: the host's part of serving.
    step_phase_shares: dict[str, float] | None = None
    gc_pause_share: float | None = None

    @property
    def host_share(self) -> float | None:
        """The share of step time spent outside the forward pass (whose time includes waiting for
        the device): scheduling, building inputs, launching sampling, detokenizing, outputs."""
        return None if self.step_phase_shares is None else 1.0 - self.step_phase_shares["forward"]

    @property
    def mean_context_len(self) -> float:
        """Average context a decode step attends over: the prompt plus half the answer."""
        return self.mean_prompt_len + self.mean_output_len / 2


def from_bench_result(path: str) -> Observations:
    """The run of a result file with the highest throughput (the last of a sweep, usually)."""
    result = load_json(path)
    runs = runs_of(result)
    run = max(runs, key=lambda r: r.get("output_throughput", 0.0))
    return from_bench_run(run, f"bench result {path}", result.get("engine_config"))


def from_bench_run(run: dict, source: str, engine: dict | None = None) -> Observations:
    """One run of a bench result (engine: the result's engine config where the run has none)."""
    if not run.get("completed"):
        raise InvalidRequestError(f"{source}: no request completed, nothing to diagnose")
    # Summary keys only (as vLLM's result files have them, or ours with records stripped);
    # per-request records, where present, add the prefix-cache hit rate.
    completed = run["completed"]
    duration = run.get("duration") or 0.0
    cached = [r.cached_tokens for r in records_of(run) if r.success and r.cached_tokens is not None]
    prompt_tokens = run["total_input_tokens"]
    return Observations(
        source=source,
        mean_prompt_len=prompt_tokens / completed,
        mean_output_len=run["total_output_tokens"] / completed,
        # Little's law: requests in flight = arrival rate x time in system.
        concurrency=run.get("mean_e2el_ms", 0.0) / 1000 * completed / duration if duration else 1.0,
        ttft_s=run.get("median_ttft_ms", 0.0) / 1000, tpot_s=run.get("median_tpot_ms", 0.0) / 1000,
        ttft_p99_s=_ms(run.get("p99_ttft_ms")), tpot_p99_s=_ms(run.get("p99_tpot_ms")),
        input_throughput=run["input_throughput"], output_throughput=run["output_throughput"],
        request_throughput=run["request_throughput"], error_rate=run.get("error_rate", 0.0),
        prefix_cache_hit_rate=sum(cached) / prompt_tokens if cached and prompt_tokens else None,
        repeated_prefixes=run.get("dataset_name") in ("prefix_repetition", "multiturn"),
        slos_ms=run.get("goodput_slos_ms"), slo_attainment=run.get("slo_attainment"),
        engine=run.get("engine_config") or engine,
        prompt_lookup_overlap=run.get("prompt_lookup_overlap"),
        spec_acceptance_rate=_percent(run.get("spec_decode_acceptance_rate")),
    )


def _ms(value: float | None) -> float | None:
    return None if value is None else value / 1000


def _percent(value: float | None) -> float | None:
    return None if value is None else value / 100


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """Every goodserve sample of one /metrics scrape, summed over labels: name -> value; for the
    SPLIT_LABELS also per value, as name{label=value}."""
    try:
        response = httpx2.get(url, timeout=timeout_s)
        response.raise_for_status()
    except httpx2.HTTPError as exc:
        raise InvalidRequestError(f"cannot read metrics from {url}: {exc}") from None
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name.startswith(PREFIX) and "le" not in sample.labels:
                name = sample.name.removeprefix(PREFIX)
                keys = [name] + [f"{name}{{{label}={sample.labels[label]}}}"
                                 for label in SPLIT_LABELS if label in sample.labels]
                for key in keys:
                    totals[key] = totals.get(key, 0.0) + sample.value
    if not totals:
        raise InvalidRequestError(f"{url} has no goodserve: metrics; is it a goodserve server's /metrics?")
    return totals


def from_metrics_url(url: str, interval_s: float = 10.0) -> Observations:
    """Rates from two scrapes interval_s apart; the server must be under load meanwhile."""
    before = scrape(url)
    start = time.monotonic()
    time.sleep(interval_s)
    after = scrape(url)
    elapsed = time.monotonic() - start
    obs = observations_from_scrapes(before, after, elapsed, url)
    obs.engine = fetch_engine_config(url)
    return obs


def observations_from_scrapes(before: dict[str, float], after: dict[str, float], elapsed_s: float,
                              url: str) -> Observations:
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    def mean_of(histogram: str) -> float:
        count = delta(f"{histogram}_count")
        return delta(f"{histogram}_sum") / count if count else 0.0

    finished = delta("e2e_request_latency_seconds_count")
    if finished <= 0:
        raise InvalidRequestError(f"no request finished at {url} during the {elapsed_s:.0f}s window; "
                                  "put the server under load (e.g. goodserve bench) while diagnosing")
    prompt, generated = delta("prompt_tokens_total"), delta("generation_tokens_total")
    queries = delta("prefix_cache_queries_total")
    draft_tokens = delta("spec_decode_num_draft_tokens_total")
    return Observations(
        source=f"live server {url} over {elapsed_s:.0f}s",
        mean_prompt_len=prompt / finished, mean_output_len=generated / finished,
        concurrency=delta("e2e_request_latency_seconds_sum") / elapsed_s,
        ttft_s=mean_of("time_to_first_token_seconds"),
        tpot_s=mean_of("request_time_per_output_token_seconds"),
        input_throughput=prompt / elapsed_s, output_throughput=generated / elapsed_s,
        request_throughput=finished / elapsed_s,
        num_preemptions=delta("num_preemptions_total"),
        kv_cache_usage=after.get("kv_cache_usage_perc"),
        num_waiting=after.get("num_requests_waiting"),
        prefix_cache_hit_rate=delta("prefix_cache_hits_total") / queries if queries else None,
        spec_acceptance_rate=delta("spec_decode_num_accepted_tokens_total") / draft_tokens if draft_tokens else None,
        step_phase_shares=_shares({phase: delta(f"step_time_seconds_total{{phase={phase}}}") for phase in STEP_PHASES}),
        gc_pause_share=delta("gc_pause_seconds_sum") / elapsed_s if "gc_pause_seconds_sum" in after else None,
    )


def _shares(seconds: dict[str, float]) -> dict[str, float] | None:
    total = sum(seconds.values())
    return {name: value / total for name, value in seconds.items()} if total > 0 else None
