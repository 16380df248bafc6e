"""Goodput capacity from the probes of a `--goodput-capacity` search, and when to distrust it.

A probe offers a Poisson rate; with few prompts the whole run is over before a queue builds, so
a probe at 256 req/s can "pass" on a server that completes 6 req/s. The capacity is therefore the
best passing probe's rate *as achieved*: min(offered rate, completed requests per second), never
more than the server did. A probe is noisy when its prompts leave too few misses of slack at the
target (one request moves attainment by 100/N points) or when it completed well below the rate it
offered (the run ended before the offered load held).
"""

from __future__ import annotations

import math

MIN_SLACK_REQUESTS = 5  # misses a probe should be able to absorb before failing the target
MIN_ACHIEVED_FRACTION = 0.9  # completed / offered below this: the probe never held its rate


def min_prompts_for(target: float) -> int:
    """Prompts a probe needs so that MIN_SLACK_REQUESTS misses still meet the target."""
    return math.ceil(MIN_SLACK_REQUESTS / max(1.0 - target, 1e-9) - 1e-6)  # 5 / (1 - 0.9) is 50.000...01


def achieved_rate(probe: dict) -> float:
    return min(probe["request_rate"], probe["request_throughput"])


def capacity_of(probes: list[dict], target: float) -> dict:
    """probes: run results with request_rate (offered), request_throughput (completed per second),
    slo_attainment (percent) and num_requests."""
    passing = [p for p in probes if p["slo_attainment"] / 100.0 >= target]
    best = max(passing, key=achieved_rate, default=None)
    rate = achieved_rate(best) if best else 0.0
    warnings = []
    num_prompts = min((p["num_requests"] for p in probes), default=0)
    if num_prompts < min_prompts_for(target):
        warnings.append(
            f"{num_prompts} prompts per probe: one request moves SLO attainment by {100 / max(num_prompts, 1):.0f} "
            f"points, so a probe can pass or fail by chance; use --num-prompts {min_prompts_for(target)} or more")
    if best and best["request_throughput"] < MIN_ACHIEVED_FRACTION * best["request_rate"]:
        warnings.append(
            f"the best passing probe offered {best['request_rate']:.3g} req/s but completed "
            f"{best['request_throughput']:.3g} req/s (the run ended before that load held): the capacity "
            f"reported is the completed rate; more prompts make each probe hold its rate")
    return {"rate": rate, "target_attainment": target, "noisy": bool(warnings), "warnings": warnings,
            "probes": [{"request_rate": p["request_rate"], "request_throughput": p["request_throughput"],
                        "slo_attainment": p["slo_attainment"]} for p in probes]}
