"""Metric math over request records: latency statistics, throughput, goodput, cost.

Definitions (the same as `vllm bench serve`, so numbers compare):
- TTFT = first chunk time - send time.
- TPOT per request = (E2E - TTFT) / (output tokens - 1); requests with one output token have none.
- ITL = gaps between consecutive chunks, pooled over all requests.
- Throughputs divide by the run's duration (first send to last completion).
- The sustained rate (goodserve's own) is the offered rate scaled by how well departures kept pace
  with arrivals while requests still arrived: see `sustained_request_rate`.
- Percentiles are numpy's linear interpolation; std is the population std (ddof=0).
Failed requests count toward the error rate and SLO attainment, never toward latency statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from goodserve.bench.records import RequestRecord
from goodserve.errors import InvalidRequestError

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILE_METRICS = LATENCY_METRICS
DEFAULT_PERCENTILES = (50.0, 90.0, 95.0, 99.0)
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class GpuCost:
    hourly_cost: float  # $ per GPU-hour
    num_gpus: int = 1


def parse_goodput_slos(items: list[str] | None) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise InvalidRequestError(
                f"bad --goodput item {item!r}: expected NAME:MILLISECONDS with NAME one of {SLO_METRICS}"
            )
        try:
            slos[name] = float(value)
        except ValueError:
            raise InvalidRequestError(f"bad --goodput item {item!r}: {value!r} is not a number") from None
        if slos[name] <= 0:
            raise InvalidRequestError(f"bad --goodput item {item!r}: the limit must be positive")
    return slos


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """A request is good if it succeeded and every given limit holds.

    A one-token output has no TPOT, so a TPOT limit cannot fail it (vLLM counts it as 0).
    """
    if not record.success:
        return False
    observed_ms = {
        "ttft": record.ttft * 1000.0,
        "tpot": (record.tpot or 0.0) * 1000.0,
        "e2el": record.e2e * 1000.0,
    }
    return all(observed_ms[name] <= limit for name, limit in slos.items())


def slo_attainment(records: list[RequestRecord], slos: dict[str, float]) -> float:
    """Fraction of all requests sent (failed ones included) that met every SLO."""
    if not records:
        return 0.0
    return sum(meets_slos(r, slos) for r in records) / len(records)


def attainment_by_slo_scale(records: list[RequestRecord], slos: dict[str, float],
                            scales: list[float]) -> list[dict[str, float]]:
    """SLO attainment (percent) with every target multiplied by each scale: DistServe's attainment vs
    SLO scale, how much tighter or looser the targets could be at this load."""
    return [{"scale": scale, "slo_attainment": 100.0 * slo_attainment(
        records, {name: limit * scale for name, limit in slos.items()})} for scale in scales]


def run_duration(records: list[RequestRecord]) -> float:
    """First send to last completion (or failure) on the benchmark clock."""
    if not records:
        return 0.0
    start = min(r.send_time for r in records)
    end = max((r.end_time if r.end_time is not None else r.send_time) for r in records)
    return end - start


def sustained_request_rate(records: list[RequestRecord], offered_rate: float) -> float:
    """Requests per second the server kept up with while the requests still arrived.

    The throughput over the whole run divides by its drain too (the longest answers finishing after
    the last arrival), so a server that held every request's SLO at 50 req/s reads 30. Here the
    window is from the first send plus the 90th-percentile latency (the in-flight set has filled)
    to the last send: in a steady state as many requests finish in it as arrive in it, so the rate
    the requests were sent at (the offered rate, or less where a concurrency limit held sends back)
    times finished / arrived there is the rate held (the offered rate when the server kept up, what
    it completed when it fell behind). A run too short or too bursty for a quarter of its requests
    to finish in that window (a handful sent at once: all in flight together) never reached a
    steady state: it reads its plain throughput, never more than it completed nor than it offered.
    """
    ok = [r for r in records if r.success and r.end_time is not None]
    duration = run_duration(records)
    completed_rate = min(offered_rate, len(ok) / duration if duration > 0 else 0.0)
    if not ok or math.isinf(offered_rate):
        return completed_rate
    first_send, window_end = min(r.send_time for r in records), max(r.send_time for r in records)
    window_start = first_send + float(np.percentile([r.e2e for r in ok], 90))
    finished = sum(window_start <= r.end_time <= window_end for r in ok)
    arrived = sum(window_start <= r.send_time <= window_end for r in records)
    if finished < len(records) / 4 or not arrived or window_end <= first_send:
        return completed_rate
    sent_rate = (len(records) - 1) / (window_end - first_send)
    return min(offered_rate, sent_rate) * min(1.0, finished / arrived)


def summarize(values_s: list[float], name: str, percentiles: tuple[float, ...]) -> dict[str, float]:
    """mean/median/std/pXX/max in milliseconds, keyed as vLLM does: `mean_ttft_ms`, `p99_ttft_ms`."""
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    empty = ms.size == 0
    stats = {
        f"mean_{name}_ms": 0.0 if empty else float(ms.mean()),
        f"median_{name}_ms": 0.0 if empty else float(np.median(ms)),
        f"std_{name}_ms": 0.0 if empty else float(ms.std()),
        f"max_{name}_ms": 0.0 if empty else float(ms.max()),
    }
    for p in percentiles:
        stats[f"p{p:g}_{name}_ms"] = 0.0 if empty else float(np.percentile(ms, p))
    return stats


def latency_samples(records: list[RequestRecord]) -> dict[str, list[float]]:
    ok = [r for r in records if r.success]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itls],
        "e2el": [r.e2e for r in ok],
    }


def cost_metrics(cost: GpuCost, duration_s: float, input_tokens: int, output_tokens: int,
                 completed: int) -> dict[str, float | None]:
    """The run's GPU time priced at $/GPU-hour, then charged wholly to each unit in turn.

    `cost_per_1m_input_tokens` is what a million input tokens cost if the GPUs did only this
    workload (same for output); they are not shares that add up.
    """
    run_cost = cost.hourly_cost * cost.num_gpus * duration_s / 3600.0

    def per(count: int, scale: float) -> float | None:
        return run_cost / count * scale if count else None

    return {
        "gpu_hourly_cost": cost.hourly_cost,
        "num_gpus": cost.num_gpus,
        "run_cost_usd": run_cost,
        "cost_per_1m_input_tokens": per(input_tokens, 1e6),
        "cost_per_1m_output_tokens": per(output_tokens, 1e6),
        "cost_per_1m_total_tokens": per(input_tokens + output_tokens, 1e6),
        "cost_per_request": per(completed, 1.0),
    }


def compute_metrics(
    records: list[RequestRecord],
    *,
    slos: dict[str, float] | None = None,
    percentile_metrics: tuple[str, ...] = DEFAULT_PERCENTILE_METRICS,
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
    cost: GpuCost | None = None,
    duration_s: float | None = None,
    offered_rate: float | None = None,
) -> dict:
    """The result-JSON metrics block for one run; with the offered rate, also the rate it sustained."""
    ok = [r for r in records if r.success]
    duration = run_duration(records) if duration_s is None else duration_s
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)

    def rate(count: float) -> float:
        return count / duration if duration > 0 else 0.0

    result: dict = {
        "duration": duration,
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "error_rate": (len(records) - len(ok)) / len(records) if records else 0.0,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": rate(len(ok)),
        "input_throughput": rate(input_tokens),
        "output_throughput": rate(output_tokens),
        "total_token_throughput": rate(input_tokens + output_tokens),
    }
    if offered_rate is not None:
        result["sustained_request_rate"] = sustained_request_rate(records, offered_rate)
    if slos:
        good = sum(meets_slos(r, slos) for r in records)
        result.update(
            goodput_slos_ms=dict(slos),
            request_goodput=rate(good),  # goodput (1): good requests per second at this load
            slo_attainment=good / len(records) * 100.0 if records else 0.0,  # goodput (2): percent
        )
    samples = latency_samples(records)
    for name in LATENCY_METRICS:
        if name in percentile_metrics:
            result.update(summarize(samples[name], name, percentiles))
    if cost is not None:
        result.update(cost_metrics(cost, duration, input_tokens, output_tokens, len(ok)))
    return result
