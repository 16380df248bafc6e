"""`goodserve router`'s settings, one field per flag."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    backends: tuple[str, ...]
    policy: str = "prefix"
    host: str = "127.0.0.1"
    port: int = 8000
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    scrape_load: bool = False
    connect_timeout_s: float = 5.0
    max_body_bytes: int = 4 << 20  # as a replica's default (`serve --max-body-bytes`)
    prefix_chunk_chars: int = 64
    prefix_tree_max_nodes: int = 100_000
    prefix_match_threshold: float = 0.3
    balance_abs_threshold: float = 32
    balance_rel_threshold: float = 1.5
    log_level: str = "info"
