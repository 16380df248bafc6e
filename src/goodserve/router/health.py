"""Periodic health checks (GET /health) that take a replica out and put it back, and its queue length
read from its /metrics for the load-aware policies."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from goodserve.router.backend import Backend
from goodserve.router.proxy import Router

QUEUE_METRICS = ("goodserve:num_requests_running", "goodserve:num_requests_waiting")


def queued_requests(metrics_text: str) -> float:
    """Running + waiting requests in a replica's /metrics (server/metrics.py's gauges)."""
    return sum(sample.value for family in text_string_to_metric_families(metrics_text)
               for sample in family.samples if sample.name in QUEUE_METRICS)


class HealthChecker:
    def __init__(self, router: Router, interval_s: float, timeout_s: float, scrape_load: bool):
        self.router = router
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.scrape_load = scrape_load

    async def check(self, backend: Backend) -> None:
        client, timeout = self.router.client, aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with client.get(f"{backend.url}/health", timeout=timeout) as response:
                if response.status != 200:
                    self.router.set_health(backend, False, f"/health answered {response.status}")
                    return
            if self.scrape_load:
                async with client.get(f"{backend.url}/metrics", timeout=timeout) as metrics:
                    backend.scraped_requests = queued_requests(await metrics.text())
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.router.set_health(backend, False, f"/health: {type(exc).__name__}: {exc}", silent=True)
            return
        self.router.set_health(backend, True)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(b) for b in self.router.backends))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check_all()
