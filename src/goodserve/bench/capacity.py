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
"""

from __future__ import annotations

import math

MIN_SLACK_REQUESTS = 5  # misses a probe should be able to absorb before failing the target
MIN_HELD_FRACTION = 0.9  # sustained / offered below this: the probe never held its rate


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


def capacity_of(probes: list[dict], target: float) -> dict:
    """probes: run results with request_rate (offered), request_throughput (completed per second),
    sustained_request_rate, slo_attainment (percent) and num_requests."""
    passing = [p for p in probes if p["slo_attainment"] / 100.0 >= target]
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
            f"reported is the sustained rate; more prompts make each probe hold its rate")
    return {"rate": rate, "held": bool(best) and held(best), "target_attainment": target, "noisy": bool(warnings),
            "warnings": warnings,
            "probes": [{"request_rate": p["request_rate"], "request_throughput": p["request_throughput"],
                        "sustained_request_rate": sustained_rate(p), "slo_attainment": p["slo_attainment"],
                        "duration": p.get("duration")} for p in probes]}
