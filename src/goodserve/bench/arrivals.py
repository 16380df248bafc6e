"""When each request is sent: all at once, constant rate, Poisson, gamma-bursty, or closed-loop.

As in `vllm bench serve`: inter-arrival gaps are gamma-distributed with shape = burstiness and
mean = 1 / rate. Burstiness 1 is a Poisson process, < 1 burstier, > 1 more even, and
`constant` gives fixed gaps. Rate inf sends everything at t=0; with --max-concurrency that is a
closed loop holding a fixed number of requests in flight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from goodserve.errors import InvalidRequestError


@dataclass(frozen=True)
class ArrivalConfig:
    request_rate: float = math.inf  # requests per second; inf: all at once
    burstiness: float = 1.0  # gamma shape; 1.0 = Poisson
    max_concurrency: int | None = None  # requests in flight at most (a semaphore)
    constant: bool = False  # fixed gaps of 1/rate instead of random ones

    def validate(self) -> None:
        if not self.request_rate > 0:
            raise InvalidRequestError(f"--request-rate must be positive (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise InvalidRequestError(f"--burstiness must be positive, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise InvalidRequestError(f"--max-concurrency must be at least 1, got {self.max_concurrency}")

    @property
    def label(self) -> str:
        if math.isinf(self.request_rate):
            return "all at once" + (f", concurrency {self.max_concurrency}" if self.max_concurrency else "")
        kind = "constant" if self.constant else ("Poisson" if self.burstiness == 1 else
                                                  f"gamma(burstiness={self.burstiness:g})")
        return f"{kind} at {self.request_rate:g} req/s"


def send_offsets(cfg: ArrivalConfig, n: int, seed: int = 0) -> list[float]:
    """Seconds after the start at which each of n requests is due; the first is due at 0."""
    cfg.validate()
    if math.isinf(cfg.request_rate) or n == 0:
        return [0.0] * n
    if cfg.constant:
        gaps = np.full(n - 1, 1.0 / cfg.request_rate)
    else:
        scale = 1.0 / (cfg.request_rate * cfg.burstiness)  # mean gap = shape * scale = 1 / rate
        gaps = np.random.default_rng(seed).gamma(cfg.burstiness, scale, size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def parse_sweep(text: str | None, name: str, cast: type = float) -> list:
    """`"1,2,4"` -> [1.0, 2.0, 4.0]; `inf` allowed for rates."""
    if not text:
        return []
    try:
        values = [cast(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InvalidRequestError(f"{name} must be a comma-separated list of numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise InvalidRequestError(f"{name} values must be positive, got {text!r}")
    return values
