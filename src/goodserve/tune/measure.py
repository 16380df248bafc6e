"""One trial: load the configuration's engine once, gate its quality against the unoptimized
baseline on it (eval's quality gate, offline), then search its goodput capacity on it (bench's
in-process runner and capacity search). A candidate past the quality budget is not timed at all:
it is rejected whatever its speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable

from rich.console import Console

from goodserve.bench.arrivals import ArrivalConfig
from goodserve.bench.capacity import probe_rate, sustained_rate
from goodserve.bench.command import Bench, add_serve_arguments, run_event_loop
from goodserve.bench.result import records_of
from goodserve.commands.quality_gate import (
    BASELINE_OPTIONS,
    EvalSettings,
    Thresholds,
    checks,
    compare,
    default_thresholds,
    measure,
    run_workload,
)
from goodserve.config import EngineConfig
from goodserve.diagnose.calc import cost_per_million_tokens
from goodserve.engine.setup.device_memory import release_dropped_memory
from goodserve.errors import GoodserveError
from goodserve.model_names import DUMMY_PREFIX

# A search starts at most this far above the best capacity so far, however much a step is predicted to give.
MAX_START_FACTOR = 4.0
MAX_DOUBLINGS = 4
# A later search probes no rate below this share of the best capacity so far: a configuration failing
# there would not be kept, and each halving makes a probe of the same prompts twice as long.
MIN_RATE_FACTOR = 0.5
QUALITY_OFF = "quality gate off: a dummy: model's random weights cannot be judged"
# --quality-budget NAME:VALUE -> the eval threshold it sets
BUDGET_NAMES = {"perplexity": "max_perplexity_increase", "top1": "min_top1_agreement",
                "greedy": "min_greedy_agreement"}


def engine_config(options: dict) -> EngineConfig:
    config = EngineConfig(**options)
    config.validate()
    return config


def options_of(config: EngineConfig) -> dict:
    """The options a configuration sets off the defaults (what `serve` needs told)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if getattr(config, f.name) != f.default and not dataclasses.is_dataclass(getattr(config, f.name))}


class QualityGate:
    """eval's gate with one baseline for every candidate: the starting configuration made
    unoptimized (full precision, no cache reuse, eager, no speculation), measured once, lazily."""

    def __init__(self, start: EngineConfig, settings: EvalSettings, budget: dict[str, float]):
        self.enabled = not start.model.startswith(DUMMY_PREFIX)
        self.baseline_config = dataclasses.replace(start, **BASELINE_OPTIONS)
        self.settings, self.budget = settings, budget
        self.workload = self.baseline = None

    def measure_baseline(self) -> None:
        """The unoptimized baseline, measured once, before any candidate's engine loads: on a GPU an engine
        takes its gpu_memory_utilization share of the card, so a baseline loaded beside one finds no room."""
        if self.enabled and self.baseline is None:
            self.workload, self.baseline = measure(self.baseline_config, self.settings, label="baseline")

    def check(self, llm) -> dict:
        """The candidate's quality on its engine (llm: the offline API over it)."""
        if not self.enabled:
            return {"checked": False, "summary": QUALITY_OFF}
        self.measure_baseline()
        run = run_workload(llm, self.workload, self.settings.max_new_tokens)
        metrics = compare(self.baseline, run)
        rows = checks(metrics, self.thresholds(llm.engine.config))
        failed = [f"{r['metric']} {r['value']:.4f} {'>' if r['op'] == '<=' else '<'} {r['limit']:.4f}"
                  for r in rows if not r["passed"]]
        summary = (f"perplexity {100 * metrics['perplexity_increase']:+.2f}%, greedy agreement "
                   f"{metrics['greedy_agreement']:.2f}" + (f"; past the budget: {', '.join(failed)}" if failed else ""))
        return {"checked": True, "passed": not failed, "metrics": metrics, "checks": rows, "summary": summary,
                "loss": metrics["perplexity_increase"]}

    def check_apart(self, config: EngineConfig) -> dict:
        """The candidate's quality on an engine loaded for it alone, freed before the next loads."""
        if not self.enabled:
            return self.check(None)
        from goodserve.engine.frontend.engine import Engine
        from goodserve.llm import LLM

        self.measure_baseline()
        engine = Engine(config)
        try:
            return self.check(LLM.over(engine))
        finally:
            engine.executor.shutdown()
            del engine
            release_dropped_memory()  # the next trial's engine gets the memory this one held

    def thresholds(self, resolved: EngineConfig) -> Thresholds:
        """eval's defaults for what the candidate changes, each overridden by --quality-budget."""
        thresholds = default_thresholds(resolved)
        for name, value in self.budget.items():
            setattr(thresholds, BUDGET_NAMES[name], value)
        return thresholds


def bench_args(model: str, workload_argv: list[str], slos_ms: dict[str, float], num_prompts: int, seed: int,
               hourly_cost: float | None, progress: bool) -> argparse.Namespace:
    """A bench command line's arguments, as `goodserve bench` parses them."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    argv = ["--backend", "inprocess", "--model", model, "--num-prompts", str(num_prompts), "--seed", str(seed),
            "--ignore-eos", "--goodput", *(f"{k}:{v:g}" for k, v in slos_ms.items()), "--goodput-capacity",
            *workload_argv]
    if hourly_cost is not None:
        argv += ["--gpu-hourly-cost", str(hourly_cost)]
    return parser.parse_args(argv + ([] if progress else ["--no-progress"]))


class TrialRunner:
    """engine_process (on CUDA): each configuration serves from a process of its own, as `goodserve serve`
    runs it (the client shares no GIL with it), and hands all its GPU memory back when that ends; its
    quality is gated on a load of its own first. Else (the CPU) one load serves both, in this process."""

    def __init__(self, gate: QualityGate, args: argparse.Namespace, console: Console, bisections: int,
                 engine_process: bool = False, out_of_time: Callable[[], bool] = lambda: False):
        self.gate, self.args, self.console, self.bisections = gate, args, console, bisections
        self.engine_process = engine_process
        self.out_of_time = out_of_time  # the budget spent: a capacity search stops probing
        self.start_rate: float | None = None  # the best capacity so far: where the next search starts

    def __call__(self, options: dict, move: str, why: str, predicted: float | None) -> dict:
        from goodserve.engine.frontend.engine import Engine
        from goodserve.llm import LLM

        engine = None
        try:
            config = engine_config(options)
            self.gate.measure_baseline()
            if self.engine_process:
                quality = self.gate.check_apart(config)
            else:
                engine = Engine(config)
                quality = self.gate.check(LLM.over(engine))
            if not quality.get("passed", True):
                if engine is not None:
                    engine.executor.shutdown()  # never served: no engine loop ends it
                return {"engine": None, "quality": quality, "capacity": None}
            return {**self.capacity(engine, config, predicted), "quality": quality}
        except (GoodserveError, RuntimeError, ValueError) as exc:  # the next configuration still runs
            return {"engine": None, "quality": {}, "capacity": None, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            del engine
            release_dropped_memory()  # the next trial's engine gets the memory this one held

    def capacity(self, engine, config: EngineConfig, predicted: float | None) -> dict:
        from goodserve.bench.inprocess import InProcessTarget

        args = argparse.Namespace(**vars(self.args))
        args.num_gpus = config.world_size  # a tensor-parallel candidate's cost counts each of its GPUs
        target = InProcessTarget(config, ignore_eos=True, slo_ms=_slos(args), engine_process=self.engine_process,
                                 engine=engine)
        bench = Bench(args, self.console, target)
        min_rate = (self.start_rate or 0.0) * MIN_RATE_FACTOR
        run_event_loop(self._search(bench, args, predicted, min_rate))
        capacity = bench.capacity
        if self.out_of_time():
            capacity["warnings"] = [*capacity["warnings"], "the budget ended this search: the capacity is the best "
                                    "rate probed so far"]
        elif capacity["rate"] == 0 and min_rate > 0:
            capacity["warnings"] = [*capacity["warnings"], f"every probe failed, the lowest at "
                                    f"{min(r['request_rate'] for r in bench.runs):.3g} req/s: below half the best "
                                    f"capacity so far ({self.start_rate:.3g} req/s) it was not searched"]
        passing = [r for r in bench.runs if r["slo_attainment"] >= 100 * capacity["target_attainment"]]
        best = max(passing, key=probe_rate, default=min(bench.runs, key=lambda r: r["request_rate"]))
        above = [r for r in bench.runs if r not in passing and r["request_rate"] > best["request_rate"]]
        at = _summary(best)
        if capacity["rate"] > 0:
            self.start_rate = max(self.start_rate or 0.0, capacity["rate"])
        return {"engine": bench.engine_config, "capacity": capacity["rate"], "capacity_noisy": capacity["noisy"],
                "capacity_warnings": capacity["warnings"], "probes": capacity["probes"], "at_capacity": at,
                "above_capacity": _summary(min(above, key=lambda r: r["request_rate"])) if above else None,
                "num_gpus": args.num_gpus, "cost_per_1m_tokens": self._cost(at, args)}

    async def _search(self, bench: Bench, args: argparse.Namespace, predicted: float | None,
                      min_rate: float) -> None:
        """From where the roofline predicts this configuration's capacity (the best so far times the
        step's predicted factor), never below min_rate; the first trial from the rate an all-at-once
        run sustained (what the server completes from a full queue: the capacity at the targets is
        usually within a doubling or a halving of it)."""
        try:
            if self.start_rate is None:
                first = await bench.run_one(ArrivalConfig(math.inf))
                args.capacity_start_rate = max(sustained_rate(first), 0.01)
            else:
                args.capacity_start_rate = self.start_rate * min(max(predicted or 1.0, 1.0), MAX_START_FACTOR)
            args.capacity_bisections = self.bisections
            # Each search starts near where the capacity is expected: a configuration still failing
            # 16x below that is hopeless, and probes at ever lower rates would take minutes each.
            args.capacity_max_doublings = MAX_DOUBLINGS
            await bench.search_capacity(self.out_of_time, min_rate)
        finally:
            await bench.target.close()

    @staticmethod
    def _cost(at: dict, args: argparse.Namespace) -> float | None:
        tokens_per_s = at.get("total_token_throughput", 0.0)
        if args.gpu_hourly_cost is None or tokens_per_s <= 0:
            return None
        return cost_per_million_tokens(args.gpu_hourly_cost, tokens_per_s, args.num_gpus)


def _slos(args: argparse.Namespace) -> dict[str, float]:
    from goodserve.bench.metrics import parse_goodput_slos

    return parse_goodput_slos(args.goodput)


def _summary(run: dict) -> dict:
    """A probe's numbers without its per-request arrays, and the share of prompt tokens the prefix cache held."""
    summary = {k: v for k, v in run.items() if not isinstance(v, list)}
    records = [r for r in records_of(run) if r.success and r.cached_tokens is not None]
    prompt_tokens = sum(r.prompt_len for r in records)
    summary["cached_prompt_share"] = sum(r.cached_tokens for r in records) / prompt_tokens if prompt_tokens else 0.0
    return summary


def quality_settings(prompts: list[str], text_file: str | None, max_text_tokens: int, max_new_tokens: int,
                     window: int) -> EvalSettings:
    settings = EvalSettings(text_file=text_file, max_text_tokens=max_text_tokens, window=window,
                            max_new_tokens=max_new_tokens)
    if prompts:
        settings.prompts = prompts
    settings.validate()
    return settings

