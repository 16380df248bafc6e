"""The router's own /metrics: requests per replica and outcome, retries, decisions, health, in-flight."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from goodserve.router.backend import Backend

PREFIX = "goodserve:router_"
# outcome: ok (2xx), http_error (the replica answered >= 400; passed through), connect_error (never
# started: retried elsewhere), timeout (the replica went silent before its response began: retried
# elsewhere, else 504), stream_error (broke after the response began: never retried).
OUTCOMES = ("ok", "http_error", "connect_error", "timeout", "stream_error")
NO_BACKEND = "none"  # the backend label of requests no healthy replica could take (503)


class BackendStateCollector:
    """Health and in-flight counts read from the replicas' state at scrape time."""

    def __init__(self, backends: list[Backend]):
        self.backends = backends

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(PREFIX + "backend_healthy", "1 while the replica takes requests.",
                                    labels=["backend"])
        in_flight = GaugeMetricFamily(PREFIX + "in_flight_requests", "Requests sent to the replica, unfinished.",
                                      labels=["backend"])
        for b in self.backends:
            healthy.add_metric([b.url], float(b.healthy))
            in_flight.add_metric([b.url], b.in_flight)
        yield healthy
        yield in_flight


class RouterMetrics:
    def __init__(self, backends: list[Backend]):
        self.registry = CollectorRegistry()
        self.registry.register(BackendStateCollector(backends))
        # process_cpu_seconds_total and the rest of Prometheus' standard process metrics: the router is
        # one Python process, and a rate of its CPU seconds near 1 says it, not the replicas, is the
        # limit (docs/serving.md).
        ProcessCollector(registry=self.registry)
        self.requests = Counter(PREFIX + "requests", "Requests by replica and outcome.", ["backend", "outcome"],
                                registry=self.registry)
        self.retries = Counter(PREFIX + "retries", "Requests sent again to another replica after one that "
                               "never started them.", registry=self.registry)
        self.decisions = Counter(PREFIX + "decisions", "Routing decisions by the policy's reason.", ["decision"],
                                 registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
