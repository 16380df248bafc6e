"""`goodserve bench`: flags named as in `vllm bench serve`, so users' scripts port.

`goodserve bench [serve] ...` runs a load test; `goodserve bench compare A.json B.json` compares.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from goodserve.bench.arrivals import ArrivalConfig, parse_sweep
from goodserve.bench.capacity import DEFAULT_MAX_PROBE_PROMPTS, capacity_of, probe_prompts, rate_resolution
from goodserve.bench.compare import compare_files
from goodserve.bench.engine_config import describe, fetch_engine_config
from goodserve.bench.metrics import (
    LATENCY_METRICS,
    GpuCost,
    attainment_by_slo_scale,
    compute_metrics,
    parse_goodput_slos,
)
from goodserve.bench.records import RequestRecord
from goodserve.bench.report import print_report, write_csv, write_html
from goodserve.bench.result import build_result, save_json, without_details
from goodserve.bench.runner import BenchRun, search_capacity
from goodserve.bench.spec_decode import (
    SpecDecodeCounts,
    fetch_spec_decode_counts,
    prompt_lookup_overlap,
    spec_decode_metrics,
)
from goodserve.bench.text import PromptText
from goodserve.bench.vllm_flags import (
    CHAT_BACKENDS,
    COMPLETIONS_BACKENDS,
    add_vllm_arguments,
    apply_general_lengths,
    backend_of,
    key_values,
    sampling_body,
)
from goodserve.bench.workloads import DATASETS, LENGTH_DISTS, BenchRequest, WorkloadConfig, build_workload
from goodserve.config import DTYPES, SCHEDULER_POLICIES
from goodserve.console import make_console
from goodserve.errors import InvalidRequestError
from goodserve.model_names import EMBEDDED_MODEL

BACKENDS = ("openai", "openai-chat", "inprocess")
ACTIONS = ("serve", "compare")


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="load-test an OpenAI-compatible endpoint or the engine",
                                   description=__doc__)
    actions = parser.add_subparsers(dest="bench_action", metavar="ACTION")
    serve = actions.add_parser("serve", help="run a benchmark (the default action)")
    add_serve_arguments(serve)
    serve.set_defaults(func=run_command)
    compare = actions.add_parser("compare", help="compare two result JSON files side by side")
    compare.add_argument("result_a")
    compare.add_argument("result_b")
    compare.set_defaults(func=lambda args: compare_files(args.result_a, args.result_b) or 0)
    add_serve_arguments(parser)  # `goodserve bench --help` lists them; with_default_action parses them as serve's
    parser.set_defaults(func=run_command)


def with_default_action(argv: list[str]) -> list[str]:
    """`goodserve bench --flags` is `goodserve bench serve --flags`: the flags then parse (or fail by
    name) as serve's, never as a misread ACTION."""
    if argv[:1] == ["bench"] and (len(argv) == 1 or argv[1] not in (*ACTIONS, "-h", "--help")):
        return ["bench", "serve", *argv[1:]]
    return argv


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--backend", default="openai", metavar="{" + ",".join(BACKENDS) + "}",
                   help=f"openai: /v1/completions; openai-chat: /v1/chat/completions; "
                        f"inprocess: goodserve's engine in this process, no HTTP. vLLM's names work too: "
                        f"{', '.join(COMPLETIONS_BACKENDS)} (as openai), {', '.join(CHAT_BACKENDS)} (as openai-chat)")
    g.add_argument("--base-url", help="server URL, e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", help="API path (default from --backend)")
    g.add_argument("--model", default=EMBEDDED_MODEL, help="model name sent to the server / loaded in-process")
    g.add_argument("--tokenizer", help="tokenizer for prompts and counts (default: --model when loadable)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer key sent to the server (default: $OPENAI_API_KEY, else none)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--dtype", default="auto", choices=DTYPES, help="inprocess: engine dtype")
    g.add_argument("--device", default="auto", help="inprocess: engine device")
    g.add_argument("--max-num-seqs", type=int,
                   help="inprocess: engine batch limit (default 256, 1024 under the slo policy)")
    g.add_argument("--engine-process", action="store_true",
                   help="inprocess: the engine in a process of its own, as goodserve serve runs it (the client "
                        "then shares no GIL with it)")
    g.add_argument("--scheduler-policy", choices=SCHEDULER_POLICIES, default="continuous",
                   help="inprocess: the engine's policy; with slo, requests carry the --goodput ttft/tpot "
                        "targets and the server's TTFT admission check refuses what it would refuse")

    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", help="ShareGPT JSON or custom JSONL file")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--random-prefix-len", type=int, default=0)
    g.add_argument("--random-length-dist", choices=LENGTH_DISTS, default="uniform",
                   help="how lengths spread around the mean; the spread is --random-range-ratio")
    g.add_argument("--sharegpt-output-len", type=int)
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)
    g.add_argument("--multiturn-num-turns", type=int, default=4)
    g.add_argument("--custom-output-len", type=int, default=256)
    g.add_argument("--custom-skip-chat-template", "--skip-chat-template", dest="skip_chat_template",
                   action="store_true", help="accepted: prompts are always sent as they are (the chat "
                                             "endpoint applies the server's template)")
    g.add_argument("--sonnet-input-len", type=int, default=550)
    g.add_argument("--sonnet-output-len", type=int, default=150)
    g.add_argument("--sonnet-prefix-len", type=int, default=200,
                   help="tokens of poem lines every sonnet prompt starts with")
    g.add_argument("--hf-output-len", type=int, help="hf: output tokens per request (default: 256)")
    g.add_argument("--hf-split", help="hf: the split the local file holds (recorded in the result)")
    g.add_argument("--hf-subset", help="hf: the subset the local file holds (recorded in the result)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--temperature", type=float, default=0.0)

    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf sends all at once")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of gaps; 1 = Poisson")
    g.add_argument("--constant-rate", action="store_true", help="fixed gaps of 1/rate")
    g.add_argument("--max-concurrency", type=int)
    g.add_argument("--num-warmups", type=int, default=0,
                   help="requests sent first and left out (prompts of their own, none of the measured ones)")
    g.add_argument("--reuse-prompts", action="store_true",
                   help="every run of a sweep or capacity search sends the first run's prompts (a longer "
                        "capacity probe draws more with the same seed) (default: run i "
                        "draws its own with seed --seed + i, so no run finds its prompts in a prefix cache the "
                        "runs before it filled; a --dataset-path file's prompts are sampled anew the same way)")
    g.add_argument("--sweep-request-rates", help="comma list: one run per rate")
    g.add_argument("--sweep-max-concurrency", help="comma list: one run per concurrency")

    g = p.add_argument_group("metrics")
    g.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="SLOs, e.g. ttft:200 tpot:50 e2el:5000")
    g.add_argument("--goodput-capacity", action="store_true",
                   help="search the highest Poisson rate whose SLO attainment >= the target")
    g.add_argument("--sweep-slo-scale", metavar="FACTORS",
                   help="comma list, e.g. 0.5,1,2: also score each run's SLO attainment with the --goodput "
                        "targets scaled by each factor (attainment vs SLO scale; the requests are not re-sent)")
    g.add_argument("--slo-attainment-target", type=float, default=0.9)
    g.add_argument("--capacity-start-rate", type=float, default=1.0)
    g.add_argument("--capacity-bisections", type=int, default=4,
                   help="probes between the last passing and the first failing rate: each halves the gap, "
                        "none once the gap is within a probe's noise (2/sqrt(--num-prompts) of the rate)")
    g.add_argument("--capacity-max-doublings", type=int, default=8,
                   help="most times the rate doubles (or, failing at the start, halves) before the bisection")
    g.add_argument("--capacity-max-prompts", type=int, default=DEFAULT_MAX_PROBE_PROMPTS,
                   help="most requests one probe sends: each after the first sends enough to run 4 times the "
                        "p90 latency the passing probes before it saw (at least --num-prompts), so it reaches a "
                        "steady state")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    g.add_argument("--metric-percentiles", default="90,95,99")
    g.add_argument("--gpu-hourly-cost", type=float, help="$ per GPU-hour, for cost per 1M tokens")
    g.add_argument("--num-gpus", type=int, default=1)

    g = p.add_argument_group("output")
    g.add_argument("--save-result", action="store_true")
    g.add_argument("--result-dir", help="where --save-result writes (default: the current directory)")
    g.add_argument("--result-filename")
    g.add_argument("--save-csv", help="per-request CSV path")
    g.add_argument("--save-html", help="HTML report path")
    g.add_argument("--disable-tqdm", "--no-progress", dest="no_progress", action="store_true")
    add_vllm_arguments(p)


def workload_config(args) -> WorkloadConfig:
    names = WorkloadConfig.__dataclass_fields__
    return WorkloadConfig(**{k: getattr(args, k) for k in names})


def make_target(args, tokenizer):
    if args.backend == "inprocess":
        from goodserve.bench.inprocess import InProcessTarget
        from goodserve.config import EngineConfig

        config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                              max_num_seqs=args.max_num_seqs, seed=args.seed, scheduler_policy=args.scheduler_policy)
        return InProcessTarget(config, ignore_eos=args.ignore_eos, temperature=args.temperature,
                               slo_ms=parse_goodput_slos(args.goodput), engine_process=args.engine_process)
    from goodserve.bench.client import HttpTarget, HttpTargetConfig, TokenCounter

    endpoint = args.endpoint or ("/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions")
    config = HttpTargetConfig(base_url=base_url_of(args), endpoint=endpoint,
                              model=args.served_model_name or args.model, api_key=args.api_key,
                              ignore_eos=args.ignore_eos, temperature=args.temperature,
                              timeout_s=args.request_timeout, extra_body=sampling_body(args),
                              headers=key_values(args.header, "--header"))
    counter = TokenCounter(tokenizer.encode if tokenizer else None)
    return HttpTarget(config, counter)


def base_url_of(args) -> str:
    return args.base_url or f"http://{args.host}:{args.port}"


def check_args(args) -> None:
    """vLLM's names and general flags resolved, and every flag checked, before any prompt is made or
    request sent."""
    args.backend_name = args.backend  # the name given, which the result keeps (as vLLM's does)
    args.backend = backend_of(args.backend)
    if args.backend not in BACKENDS:
        raise InvalidRequestError(f"--backend {args.backend!r}: choose from {', '.join(BACKENDS)} (or vLLM's "
                                  f"{', '.join(COMPLETIONS_BACKENDS + CHAT_BACKENDS)})")
    if args.backend == "inprocess" and (sampling_body(args) or args.header or args.served_model_name):
        raise InvalidRequestError("--backend inprocess sends no HTTP requests: --header, --extra-body, "
                                  "--served-model-name and the sampling flags apply to openai / openai-chat")
    if args.dataset_path and args.dataset_name in ("random", "prefix_repetition", "multiturn", "copy"):
        raise InvalidRequestError(f"--dataset-name {args.dataset_name} makes its prompts: --dataset-path "
                                  f"{args.dataset_path} needs sharegpt, sonnet, hf or custom")
    apply_general_lengths(args)
    args.metadata_pairs = key_values(args.metadata, "--metadata")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise InvalidRequestError("--max-concurrency must be at least 1")
    if args.capacity_max_prompts < 1:
        raise InvalidRequestError("--capacity-max-prompts must be at least 1")


def engine_config_of(args, target) -> dict[str, str] | None:
    """The engine the run measures: the server's /metrics info metric, or the in-process engine's."""
    if args.backend == "inprocess":
        from goodserve.server.metrics import engine_info

        return engine_info(target.engine)
    return fetch_engine_config(f"{target.config.base_url.rstrip('/')}/metrics", args.api_key)


def settings_of(args, arrivals: ArrivalConfig, target, tokenizer_id: str | None,
                engine_config: dict[str, str] | None) -> dict:
    hf = {name: getattr(args, name) for name in ("hf_split", "hf_subset") if getattr(args, name)}
    return {
        "endpoint_type": args.backend_name, "backend": args.backend_name, "label": args.label,
        "base_url": getattr(target, "config", None) and target.config.base_url,
        "endpoint": getattr(target, "config", None) and target.config.endpoint,
        "model_id": args.model, "tokenizer_id": tokenizer_id, "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts, "request_rate": arrivals.request_rate,
        "burstiness": arrivals.burstiness, "max_concurrency": arrivals.max_concurrency,
        "arrivals": arrivals.label, "num_warmups": args.num_warmups, "engine_config": engine_config,
        **hf, **args.metadata_pairs,
    }


def prompt_seed(args, run_index: int) -> int:
    """The seed of run run_index's prompts: a new draw each run unless --reuse-prompts."""
    return args.seed if args.reuse_prompts else args.seed + run_index


# Warm-up prompts are drawn with the run's seed plus this: never a seed a run's own prompts take.
WARMUP_SEED_OFFSET = 1_000_000


class Bench:
    """One invocation: shared target and workload, one or more runs, results saved even on failure.
    target: one the caller built (goodserve tune hands in an engine it loaded); else from args."""

    def __init__(self, args, console: Console, target=None):
        check_args(args)
        self.args = args
        self.console = console
        self.slos = parse_goodput_slos(args.goodput)
        self.percentile_metrics = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
        unknown = set(self.percentile_metrics) - set(LATENCY_METRICS)
        if unknown:
            raise InvalidRequestError(f"--percentile-metrics: unknown {sorted(unknown)}; use {LATENCY_METRICS}")
        self.percentiles = tuple(parse_sweep(args.metric_percentiles, "--metric-percentiles"))
        self.cost = GpuCost(args.gpu_hourly_cost, args.num_gpus) if args.gpu_hourly_cost else None
        if args.goodput_capacity and not self.slos:
            raise InvalidRequestError("--goodput-capacity needs SLOs: add --goodput ttft:MS tpot:MS")
        self.slo_scales = parse_sweep(args.sweep_slo_scale, "--sweep-slo-scale")
        if self.slo_scales and not self.slos:
            raise InvalidRequestError("--sweep-slo-scale needs SLOs: add --goodput ttft:MS tpot:MS")
        self.tokenizer = self._tokenizer()
        self.requests = self._workload(0)  # the current run's: each run draws its own (prompt_seed)
        if target is None and args.backend != "inprocess":
            from goodserve.bench.client import check_reachable

            check_reachable(base_url_of(args), args.ready_check_timeout_sec)
        self.target = target or make_target(args, self.tokenizer)
        self.engine_config = engine_config_of(args, self.target)
        if self.engine_config:
            console.print(f"engine: {describe(self.engine_config)}")
        self.runs: list[dict] = []
        self.spec_before: SpecDecodeCounts | None = None  # the current run's counters after its warm-up
        self.capacity: dict | None = None

    def _tokenizer(self):
        from goodserve.bench.tokenizer import load_bench_tokenizer

        name = self.args.tokenizer or self.args.model
        tokenizer = load_bench_tokenizer(name)
        if tokenizer is None:
            self.console.print(f"[yellow]no tokenizer for {name!r} here: prompt lengths are approximate "
                               f"(words) and output counts come from the server's usage[/yellow]")
        return tokenizer

    def arrival_plan(self) -> list[ArrivalConfig]:
        a = self.args
        base = ArrivalConfig(a.request_rate, a.burstiness, a.max_concurrency, a.constant_rate)
        rates = parse_sweep(a.sweep_request_rates, "--sweep-request-rates")
        concurrencies = parse_sweep(a.sweep_max_concurrency, "--sweep-max-concurrency", int)
        plan = [ArrivalConfig(r, a.burstiness, a.max_concurrency, a.constant_rate) for r in rates]
        plan += [ArrivalConfig(math.inf, a.burstiness, c) for c in concurrencies]
        for arrivals in plan or [base]:
            arrivals.validate()
        return plan or [base]

    def _workload(self, run_index: int, warmup: bool = False, count: int | None = None) -> list[BenchRequest]:
        """count: prompts drawn (default --num-prompts); a larger count samples (or cycles) a dataset further."""
        seed = prompt_seed(self.args, run_index) + (WARMUP_SEED_OFFSET if warmup else 0)
        count = self.args.num_warmups if warmup else count or self.args.num_prompts
        config = dataclasses.replace(workload_config(self.args), num_prompts=count, seed=seed)
        return build_workload(config, PromptText(self.tokenizer, seed))

    async def run_one(self, arrivals: ArrivalConfig, count: int | None = None) -> dict:
        """count: requests sent (default --num-prompts)."""
        count = count or self.args.num_prompts
        if (self.runs and not self.args.reuse_prompts) or len(self.requests) != count:
            self.requests = self._workload(len(self.runs), count=count)
        warmups = self._workload(len(self.runs), warmup=True) if self.args.num_warmups > 0 else []
        run = BenchRun(self.target, list(self.requests), arrivals, self.args.seed, warmups)
        settings = {**settings_of(self.args, arrivals, self.target, self.args.tokenizer or self.args.model,
                                  self.engine_config), "prompt_seed": prompt_seed(self.args, len(self.runs)),
                    "num_prompts": count}
        self.spec_before = None
        run.on_start = self._note_spec_decode_counts
        with self._progress(arrivals) as hook:
            run.on_record = hook
            try:
                await run.run()
            finally:
                # Whatever finished is reported, even if the run was cut short.
                self.runs.append(self._result(settings, run.records))
        return self.runs[-1]

    def _spec_decode_counts(self) -> SpecDecodeCounts | None:
        """The server's speculative-decoding counters (None: it has none, or the target is in-process)."""
        if self.args.backend == "inprocess":
            return None
        return fetch_spec_decode_counts(f"{self.target.config.base_url.rstrip('/')}/metrics", self.args.api_key)

    def _note_spec_decode_counts(self) -> None:
        self.spec_before = self._spec_decode_counts()

    def _result(self, settings: dict, records: list[RequestRecord]) -> dict:
        metrics = compute_metrics(records, slos=self.slos, percentile_metrics=self.percentile_metrics,
                                  percentiles=self.percentiles, cost=self.cost, offered_rate=settings["request_rate"])
        if self.slo_scales:
            metrics["slo_scale_sweep"] = attainment_by_slo_scale(records, self.slos, self.slo_scales)
        metrics["prompt_lookup_overlap"] = prompt_lookup_overlap([
            (" ".join(m["content"] for m in self.requests[r.index].chat_messages()), r.generated_text)
            for r in records if r.success], self.tokenizer)
        spec_after = self._spec_decode_counts() if self.spec_before is not None else None
        if spec_after:
            metrics.update(spec_decode_metrics(spec_after - self.spec_before))
        return build_result(settings, metrics, records)

    @contextlib.contextmanager
    def _progress(self, arrivals: ArrivalConfig):
        """A rich progress bar; yields the hook that advances it per finished request."""
        columns = (TextColumn(f"[bold]{arrivals.label}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn())
        with Progress(*columns, console=self.console, disable=self.args.no_progress) as progress:
            task = progress.add_task("bench", total=len(self.requests), failed=0)
            failed = 0

            def hook(record: RequestRecord) -> None:
                nonlocal failed
                failed += not record.success
                progress.update(task, advance=1, failed=failed)

            yield hook

    async def search_capacity(self, out_of_time: Callable[[], bool] = lambda: False, min_rate: float = 0.0) -> None:
        """The capacity search; no probe after the first starts once `out_of_time()` (tune's budget),
        nor any below `min_rate` (a capacity tune would not keep)."""
        a = self.args

        async def attainment_at(rate: float) -> float:
            count = probe_prompts(rate, self.runs, a.slo_attainment_target, a.num_prompts, a.capacity_max_prompts)
            result = await self.run_one(ArrivalConfig(rate, a.burstiness, a.max_concurrency), count)
            return result["slo_attainment"] / 100.0

        await search_capacity(attainment_at, a.slo_attainment_target, a.capacity_start_rate,
                              a.capacity_max_doublings, a.capacity_bisections, out_of_time,
                              rate_resolution(a.num_prompts), min_rate)
        self.capacity = {**capacity_of(self.runs, a.slo_attainment_target), "slos_ms": self.slos}

    async def execute(self) -> None:
        try:
            if self.args.goodput_capacity:
                await self.search_capacity()
            else:
                for arrivals in self.arrival_plan():
                    await self.run_one(arrivals)
        finally:
            await self.target.close()

    def result(self) -> dict:
        if len(self.runs) == 1 and self.capacity is None:
            return self.runs[0]
        result = {"model_id": self.args.model, "backend": self.args.backend_name,
                  "engine_config": self.engine_config, "sweep": self.runs}
        if self.capacity is not None:
            result["capacity"] = self.capacity
        return result

    def save(self, result: dict) -> None:
        a = self.args
        if a.save_result or a.append_result or a.result_filename:
            path = Path(a.result_dir or ".") / (a.result_filename or result_filename(a, result))
            save_json(result if a.save_detailed else without_details(result), path, append=a.append_result)
            self.console.print(f"result {'appended' if a.append_result else 'written'} to {path}")
        if a.save_csv:
            write_csv(result, Path(a.save_csv))
            self.console.print(f"per-request CSV written to {a.save_csv}")
        if a.save_html:
            write_html(result, Path(a.save_html))
            self.console.print(f"HTML report written to {a.save_html}")


def result_filename(args, result: dict) -> str:
    """vLLM's name: LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json (the label defaults to the backend)."""
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    model = Path(args.model).name.replace(":", "_")
    return (f"{args.label or args.backend_name}-{args.request_rate}qps{concurrency}-{model}-"
            f"{result.get('date', 'sweep')}.json")


def run_event_loop(main) -> None:
    """main() on uvloop where installed: asyncio's own selector delays every event a busy client times
    (at 60 req/s of 256-chunk streams, a 20 ms TTFT reported as 121 ms median on asyncio's loop, 27 ms
    on uvloop: benchmarks/BENCHMARKS.md, "Replicas behind the router")."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def run_command(args) -> int:
    console = make_console()
    bench = Bench(args, console)
    interrupted = False
    try:
        run_event_loop(bench.execute())
    except KeyboardInterrupt:
        interrupted = True
        console.print("[yellow]interrupted: reporting the requests that finished[/yellow]")
    if not bench.runs:
        return 130 if interrupted else 1
    result = bench.result()
    print_report(result, console)
    bench.save(result)
    return _exit_status(bench.runs, interrupted)


def _exit_status(runs: list[dict], interrupted: bool) -> int:
    """0 when every request succeeded; 1 (with the errors summarized) when any failed."""
    if interrupted:
        return 130
    errors = [e for run in runs for e in run["errors"] if e]
    if not errors:
        return 0
    total = sum(run["num_requests"] for run in runs)
    counts: dict[str, int] = {}
    for e in errors:
        counts[e] = counts.get(e, 0) + 1
    print(f"goodserve bench: {len(errors)} of {total} requests failed; most common errors:", file=sys.stderr)
    for message, count in sorted(counts.items(), key=lambda kv: -kv[1])[:3]:
        print(f"  {count} x {message}", file=sys.stderr)
    return 1
