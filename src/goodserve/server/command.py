"""`goodserve serve`: the OpenAI-compatible server. With no arguments: the embedded model, on loopback."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from pathlib import Path

from goodserve.engine_args import add_dataclass_arguments, add_engine_arguments, dataclass_from_args
from goodserve.engine.disagg.disagg_layout import parse_disaggregate
from goodserve.engine.processes.gc_pauses import serving_settings
from goodserve.errors import InvalidRequestError
from goodserve.router.config import RouterConfig
from goodserve.router.policies import POLICIES
from goodserve.server.config_file import apply_config_file
from goodserve.server.recording import RECORD_PROMPTS

_SERVER_HELP = {
    "host": "address to bind; the default keeps the server on this machine (default: 127.0.0.1)",
    "port": "TCP port",
    "api_key": "require 'Authorization: Bearer <key>' (default: $GOODSERVE_API_KEY, else no key)",
    "served_model_name": "the model name clients send (default: the --model value)",
    "max_waiting": "most requests waiting for the engine; more get 429 with Retry-After",
    "max_body_bytes": "largest request body; larger get 413",
    "request_timeout_s": "abort requests not finished within this many seconds (408) (default: none)",
    "drain_timeout_s": "on SIGTERM, how long in-flight requests may take to finish",
    "slo_ttft_ms": "time-to-first-token target counted in goodserve:request_slo (default: none)",
    "slo_tpot_ms": "time-per-output-token target counted in goodserve:request_slo (default: none)",
    "gpu_hourly_cost": "$ per GPU-hour: /metrics reports goodserve:cost_per_hour_dollars (this times the GPUs the "
                       "engine uses), from which the dashboard computes the cost per 1M tokens (default: none)",
    "slo_shed_costly": "under --scheduler-policy slo, as the queue builds refuse (429) the costliest requests first "
                       "(prompt tokens, and max_tokens: a request without it asks for the rest of the context): "
                       "more requests a second within their targets past capacity, long ones refused sooner "
                       "(docs/serving.md)",
    "log_level": "uvicorn and goodserve log level",
    "max_unsent_outputs": "a stream whose client stops reading is aborted (its KV blocks freed) once this many "
                          "engine outputs (about one per token) wait unsent",
    "stream_interval": "streamed responses send a choice's first token at once, then chunks of at least this "
                       "many tokens (and the last): fewer, larger SSE events, less host work a token; 1: "
                       "every token its own (default: 1)",
    "header_timeout_s": "close a connection that has not sent complete request headers this long after opening "
                        "(or after its last response)",
    "max_connections": "open connections past this get 503 with Retry-After (default: the open-file limit, "
                       "raised to its hard maximum, less the files open at start and 64)",
    "keep_alive_s": "close a kept-alive connection idle this long; longer than clients' own idle expiry (httpx 5s, "
                    "aiohttp 15s), so a client never sends on a connection the server is closing",
    "generation_config": "auto: a request's unset temperature, top_p, top_k, min_p and repetition_penalty take "
                         "the values the model's generation_config.json recommends (a Hugging Face model "
                         "directory's; vLLM's default); none: the API's own (OpenAI's temperature 1, top_p 1) "
                         "(default: auto)",
    "pooling": "how /v1/embeddings pools a prompt's final hidden states: the last token's (default, as vLLM "
               "does for decoder models) or their mean; either is L2-normalized",
    "allow_unknown_fields": "ignore request fields this server does not know (a warning is logged) instead of "
                            "answering 400; fields OpenAI defines that goodserve does not implement are still refused",
    "data_dir": "where the Batch API keeps its files, jobs and each line's result (SQLite); a server started "
                "again on it resumes unfinished jobs (default: $XDG_DATA_HOME/goodserve, else "
                "~/.local/share/goodserve)",
    "batch_max_concurrency": "most batch lines in the engine at once (they run at the lowest priority)",
    "batch_max_file_bytes": "largest file POST /v1/files takes; larger get 413",
    "engine_process": "run the engine (scheduler, model, sampling, detokenization) in a process of its own, so the "
                      "HTTP event loop and the engine do not share one GIL: 1.7x the output tokens/s at 256 streams "
                      "on an H200; --no-engine-process steps it on a thread of the server's process (default: on, "
                      "except with --disaggregate, whose decode engine is in the server's process; docs/serving.md)",
    "record_requests": "append one JSON line per accepted prompt to this file: its arrival time, token count, "
                       "max_tokens and the prompt (hashed or kept, --record-prompts), a recording goodserve tune "
                       "--workload FILE replays (docs/tune.md) (default: none)",
    "record_prompts": "--record-requests: hash keeps a SHA-256 of each prompt's tokens (repeats stay visible, the "
                      "text does not); keep writes the prompt text",
    "backlog": "listen backlog: connections the kernel queues before the server accepts them (capped by "
               "net.core.somaxconn)",
}


def register(subparsers) -> None:
    from goodserve.server.app import ServerConfig

    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="OpenAI-compatible server (/v1/completions, /v1/chat/completions, /metrics, ...).",
    )
    add_dataclass_arguments(parser, ServerConfig, "server options", _SERVER_HELP,
                            {"log_level": ("critical", "error", "warning", "info", "debug"),
                             "pooling": ("last", "mean"), "generation_config": ("auto", "none"),
                             "record_prompts": RECORD_PROMPTS})
    parser.set_defaults(api_key=os.environ.get("GOODSERVE_API_KEY"))
    replicas = parser.add_argument_group("replicas")
    replicas.add_argument("--data-parallel-size", type=int, default=1, metavar="R",
                          help="R engine servers on loopback ports (one GPU each on CUDA; on the CPU they share "
                               "its cores) and the router in front of them on --host:--port (docs/serving.md)")
    replicas.add_argument("--router-policy", choices=POLICIES, default=RouterConfig(backends=()).policy,
                          help="with --data-parallel-size: how the router picks a replica (goodserve router --policy)")
    replicas.add_argument("--disaggregate", metavar="prefill:ID,decode:ID",
                          help="prefill and decode in two engines: this process decodes on GPU ID, a child process "
                               "prefills on its GPU and sends each prompt's KV over torch.distributed (on the CPU "
                               "the ids only name the processes) (docs/serving.md)")
    add_engine_arguments(parser)
    parser.add_argument("--config", metavar="FILE",
                        help="a JSON object of these options, e.g. the serve-config.json goodserve tune writes: "
                             '{"quantization": "gguf", "max_num_seqs": 64}; a flag given here with a value other '
                             "than its default wins over the file")
    parser.set_defaults(func=lambda args: run(args, parser))


def _check(config, args: argparse.Namespace) -> None:
    if config.max_waiting < 1:
        raise InvalidRequestError("--max-waiting must be at least 1")
    if config.max_body_bytes < 1024:
        raise InvalidRequestError("--max-body-bytes must be at least 1024")
    if not 0 <= config.port < 65536:
        raise InvalidRequestError("--port must be in [0, 65535]")
    if min(config.max_unsent_outputs, config.stream_interval, config.header_timeout_s, config.backlog,
           config.keep_alive_s) <= 0:
        raise InvalidRequestError("--max-unsent-outputs, --stream-interval, --header-timeout-s, --backlog and "
                                  "--keep-alive-s must be positive")
    if config.batch_max_concurrency < 1 or config.batch_max_file_bytes < 1:
        raise InvalidRequestError("--batch-max-concurrency and --batch-max-file-bytes must be positive")
    if config.gpu_hourly_cost is not None and config.gpu_hourly_cost < 0:
        raise InvalidRequestError("--gpu-hourly-cost must not be negative")
    if any(target is not None and target <= 0 for target in (config.slo_ttft_ms, config.slo_tpot_ms)):
        raise InvalidRequestError("--slo-ttft-ms and --slo-tpot-ms must be positive")
    if config.max_connections is not None and config.max_connections < 1:
        raise InvalidRequestError("--max-connections must be at least 1")
    if config.slo_shed_costly and args.scheduler_policy != "slo":
        raise InvalidRequestError("--slo-shed-costly sheds in the slo policy's admission check: add "
                                  "--scheduler-policy slo")
    if config.record_requests and not Path(config.record_requests).expanduser().parent.is_dir():
        raise InvalidRequestError(f"--record-requests {config.record_requests}: its folder does not exist")
    if args.data_parallel_size < 1:
        raise InvalidRequestError("--data-parallel-size must be at least 1")
    if args.disaggregate is not None and args.data_parallel_size > 1:
        raise InvalidRequestError("--disaggregate and --data-parallel-size are not combined yet: give one")
    if args.disaggregate is not None and config.engine_process:
        raise InvalidRequestError("--disaggregate runs its decode engine in the serving process: drop --engine-process")
    serving_settings()  # the environment's collector threshold and switch interval, before any loading


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from goodserve.engine.frontend.preflight import checked_engine_config
    from goodserve.server.app import ServerConfig

    if args.config:
        apply_config_file(args, parser, args.config)
    config = dataclass_from_args(ServerConfig, args)
    _check(config, args)
    engine_config = checked_engine_config(args)
    layout = parse_disaggregate(args.disaggregate) if args.disaggregate is not None else None
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not _is_loopback(config.host) and not config.api_key:
        logging.getLogger("goodserve.server").warning(
            "binding %s without --api-key: anyone who can reach this port can use the model", config.host)
    if args.data_parallel_size > 1:
        from goodserve.server.replicas import run_replicas

        run_replicas(engine_config, config, args.data_parallel_size, args.router_policy)
        return 0
    from goodserve.cpu_threads import apply_thread_plan, plan_threads
    from goodserve.engine.frontend.async_engine import AsyncEngine  # torch loads only when serving
    from goodserve.server.app import run_server
    from goodserve.server.metrics import engine_info

    threads = plan_threads(config.engine_process is not False and layout is None, engine_config.world_size)
    apply_thread_plan(threads)
    logging.getLogger("goodserve.server").info(threads.describe())

    if layout is not None:
        from goodserve.server.disaggregated import DisaggregatedEngine

        engine = DisaggregatedEngine(engine_config, layout)
    elif config.engine_process is not False:
        from goodserve.engine.frontend.engine_process import EngineProcess

        engine = EngineProcess(engine_config)
    else:
        engine = AsyncEngine(engine_config)
    # What auto resolved to (dtype, KV dtype, kernels), as /metrics reports it in engine_config_info.
    logging.getLogger("goodserve.server").info(
        "engine: %s", " ".join(f"{k}={v}" for k, v in engine_info(engine).items()))
    run_server(engine, config)
    return 0
