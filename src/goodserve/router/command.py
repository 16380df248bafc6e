"""`goodserve router`: one OpenAI-compatible endpoint in front of several `goodserve serve` replicas."""

from __future__ import annotations

import argparse
import logging

from goodserve.errors import InvalidRequestError
from goodserve.router.config import RouterConfig
from goodserve.router.policies import POLICIES


def register(subparsers) -> None:
    defaults = RouterConfig(backends=())
    parser = subparsers.add_parser(
        "router", help="route OpenAI requests over several goodserve replicas",
        description="A load- and prefix-aware router over `goodserve serve` replicas, with health checks, retry "
                    "of requests that never started, and its own /metrics (goodserve:router_*).")
    parser.add_argument("--backend", action="append", required=True, dest="backends", metavar="URL",
                        help="a replica's base URL, e.g. http://10.0.0.2:8000; repeat for each replica")
    parser.add_argument("--policy", choices=POLICIES, default=defaults.policy,
                        help="prefix: where the prompt's prefix was served (least-load when the loads are far "
                             "apart or nothing matched); least-load: fewest requests on the replica; "
                             "round-robin: in turn")
    parser.add_argument("--host", default=defaults.host, help="address to bind")
    parser.add_argument("--port", type=int, default=defaults.port, help="TCP port")
    parser.add_argument("--health-interval-s", type=float, default=defaults.health_interval_s,
                        help="seconds between health checks (GET /health) of each replica")
    parser.add_argument("--health-timeout-s", type=float, default=defaults.health_timeout_s,
                        help="a replica that does not answer its health check in this long is taken out")
    parser.add_argument("--scrape-load", action="store_true",
                        help="also read each replica's goodserve:num_requests_running + _waiting from its /metrics "
                             "at each health check (when other routers or clients send it work too); without it the "
                             "router counts its own requests, which is exact and never stale when it is the only one")
    parser.add_argument("--connect-timeout-s", type=float, default=defaults.connect_timeout_s,
                        help="a replica not accepting the connection this fast is skipped (the request retried)")
    parser.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes,
                        help="largest request body; larger get 413 before the router reads them "
                             "(the replicas' own --max-body-bytes applies too)")
    parser.add_argument("--prefix-chunk-chars", type=int, default=defaults.prefix_chunk_chars,
                        help="prefix policy: granularity of the prefix tree, in characters")
    parser.add_argument("--prefix-tree-max-nodes", type=int, default=defaults.prefix_tree_max_nodes,
                        help="prefix policy: chunks remembered (least recently used forgotten first)")
    parser.add_argument("--prefix-match-threshold", type=float, default=defaults.prefix_match_threshold,
                        help="prefix policy: share of the prompt that must match to follow the prefix")
    parser.add_argument("--balance-abs-threshold", type=float, default=defaults.balance_abs_threshold,
                        help="prefix policy: least-load decides when the busiest replica has this many more "
                             "requests than the idlest ...")
    parser.add_argument("--balance-rel-threshold", type=float, default=defaults.balance_rel_threshold,
                        help="... and this many times as many")
    parser.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"),
                        default=defaults.log_level, help="log level")
    parser.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    fields = RouterConfig.__dataclass_fields__
    config = RouterConfig(**{name: getattr(args, name) for name in fields if name != "backends"},
                          backends=tuple(args.backends))
    if not all(url.startswith(("http://", "https://")) for url in config.backends):
        raise InvalidRequestError("--backend takes a URL starting with http:// or https://")
    if len(set(config.backends)) != len(config.backends):
        raise InvalidRequestError("--backend names a replica twice")
    if min(config.health_interval_s, config.health_timeout_s, config.connect_timeout_s) <= 0:
        raise InvalidRequestError("--health-interval-s, --health-timeout-s and --connect-timeout-s must be positive")
    if config.max_body_bytes < 1:
        raise InvalidRequestError("--max-body-bytes must be positive")
    if config.prefix_chunk_chars < 1 or config.prefix_tree_max_nodes < 1:
        raise InvalidRequestError("--prefix-chunk-chars and --prefix-tree-max-nodes must be positive")
    return config


def run(args: argparse.Namespace) -> int:
    from goodserve.router.app import run_router

    config = config_from_args(args)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_router(config)
    return 0
