"""Goodput capacity from the probes of a `--goodput-capacity` search, and when to distrust it.

A probe offers a Poisson rate. Its completed requests per second understate what a server that
kept up held (they divide by the drain of the longest answers too), and overstate nothing; its
sustained rate (metrics.sustained_request_rate) reads the offered rate when departures kept pace
with arrivals and what it completed when they did not. With few prompts the whole run is over
before a queue builds, so a probe at 256 req/s can "pass" on a server that completes 6 req/s:
such a run never reaches a steady state and its sustained rate is its completed rate. The
capacity is therefore the best passing probe's offered rate when that probe held it (sustained
>= 90% of offered), else the rate it sustained: never more than the server showed. A probe is
noisy when its prompts leave too few misses of slack at the target (one request moves attainment
by 100/N points) or when it did not hold the rate it offered.

So a probe is made long enough to reach its steady state (probe_prompts): a search's first sends
--num-prompts requests, each later one at rate r max(--num-prompts, r * STEADY_LATENCIES * the
longest p90 end-to-end latency of the passing rated probes before it), at most
--capacity-max-prompts. The sustained window (from the first send plus that latency to the last
send) then covers 3/4 of its arrivals. At 85 req/s, 1,000 ShareGPT-like prompts arrive in 12 s
while their p90 latency is 8 s: no steady state can show, and such a probe reads its drain-bound
throughput whatever the server held. A probe the cap cut short still reads what it sustained.
"""

from __future__ import annotations

import math

import numpy as np

MIN_SLACK_REQUESTS = 5  # misses a probe should be able to absorb before failing the target
MIN_HELD_FRACTION = 0.9  # sustained / offered below this: the probe never held its rate
STEADY_LATENCIES = 4  # a later probe sends for this many p90 latencies: its sustained window is 3/4 of it
DEFAULT_MAX_PROBE_PROMPTS = 4000  # so that no probe runs away (44 s at 90 req/s)


def min_prompts_for(target: float) -> int:
    """Prompts a probe needs so that MIN_SLACK_REQUESTS misses still meet the target."""
    return math.ceil(MIN_SLACK_REQUESTS / max(1.0 - target, 1e-9) - 1e-6)  # 5 / (1 - 0.9) is 50.000...01


def rate_resolution(num_prompts: int) -> float:
    """The relative gap between two rates one probe of num_prompts cannot tell apart: N Poisson
    arrivals realize their rate within 1/sqrt(N) of it (one standard deviation), so rates closer
    than two of those are the same to a probe. A search bisects no finer (0.063 at 1,000 prompts)."""
    return 2.0 / math.sqrt(max(num_prompts, 1))


def sustained_rate(probe: dict) -> float:
    """A result written before probes carried a sustained rate reads its completed rate."""
    return probe.get("sustained_request_rate", probe["request_throughput"])


def held(probe: dict) -> bool:
    return sustained_rate(probe) >= MIN_HELD_FRACTION * probe["request_rate"]


def probe_rate(probe: dict) -> float:
    """The rate a probe showed its server serves: the offered rate when it held it, else what it sustained."""
    return probe["request_rate"] if held(probe) else sustained_rate(probe)


def passed(probe: dict, target: float) -> bool:
    return probe["slo_attainment"] / 100.0 >= target


def p90_latency(probe: dict) -> float:
    """The 90th-percentile end-to-end latency (s) of a probe's successful requests (0 without any)."""
    latencies = [latency for latency, error in zip(probe["latencies"], probe["errors"]) if not error]
    return float(np.percentile(latencies, 90)) if latencies else 0.0


def probe_prompts(rate: float, earlier: list[dict], target: float, num_prompts: int, max_prompts: int) -> int:
    """Requests a probe at `rate` sends: num_prompts, or enough to arrive over STEADY_LATENCIES times
    the longest p90 latency the earlier passing rated probes saw, at most max_prompts (never below
    num_prompts). An all-at-once run's latency is its whole queue's, no steady state's: it sets none."""
    rated = [p for p in earlier if passed(p, target) and not math.isinf(p["request_rate"])]
    latency = max(map(p90_latency, rated), default=0.0)
    if math.isinf(rate) or latency <= 0:
        return num_prompts
    return max(num_prompts, min(max_prompts, math.ceil(rate * STEADY_LATENCIES * latency)))


def capacity_of(probes: list[dict], target: float) -> dict:
    """probes: run results with request_rate (offered), request_throughput (completed per second),
    sustained_request_rate, slo_attainment (percent) and num_requests."""
    passing = [p for p in probes if passed(p, target)]
    best = max(passing, key=probe_rate, default=None)
    rate = probe_rate(best) if best else 0.0
    warnings = []
    num_prompts = min((p["num_requests"] for p in probes), default=0)
    if num_prompts < min_prompts_for(target):
        warnings.append(
            f"{num_prompts} prompts per probe: one request moves SLO attainment by {100 / max(num_prompts, 1):.0f} "
            f"points, so a probe can pass or fail by chance; use --num-prompts {min_prompts_for(target)} or more")
    if best and not held(best):
        warnings.append(
            f"the best passing probe offered {best['request_rate']:.3g} req/s but sustained "
            f"{sustained_rate(best):.3g} req/s (the run ended before that load held): the capacity "
            f"reported is the sustained rate; more prompts per probe (--capacity-max-prompts) make it hold its rate")
    return {"rate": rate, "held": bool(best) and held(best), "target_attainment": target, "noisy": bool(warnings),
            "warnings": warnings,
            "probes": [{"request_rate": p["request_rate"], "request_throughput": p["request_throughput"],
                        "sustained_request_rate": sustained_rate(p), "slo_attainment": p["slo_attainment"],
                        "num_requests": p["num_requests"], "duration": p.get("duration")} for p in probes]}
