"""What a step trace (`serve --step-trace FILE`, engine/core/step_trace.py) says about TPOT.

A request's TPOT is the mean of the steps it sat through, so the steps that outlast the TPOT target
are where TPOT misses come from, and their shape says which knob shortens them. The trace's own
steps are fitted (the engine's step-time model over all of them: t = a + b x decode rows + c x prompt
tokens + d x context tokens), and each step over the target is put down to one of two causes:

- its decode rows alone (the fit's a + b x rows + d x context) outlast the target: the running batch
  is larger than the target allows. The fix is fewer sequences at once, the most whose decode step
  fits the target at the trace's mean context a row (`--max-num-seqs`), or the slo policy, which
  sizes the batch from the target as it goes;
- the decode rows fit and the prompt tokens mixed in push it over: a smaller step budget
  (`--max-num-batched-tokens`: the median such step's decode rows, which the budget counts too, and
  the prompt tokens that fit beside them), or the slo policy, which caps them per step. Only where
  that budget still leaves the prompts room: at the trace's largest batches (its steps of the 10%
  most decode rows) it must carry, per second, the prompt tokens the trace's steps carried while
  prompts came. Below that, prefill falls behind and the queue grows without bound: on an H200 at
  69 req/s a budget of 963 beside ~600 decode rows took FCFS from 85% to 20.5% SLO attainment (p99
  TTFT 25 s), every step within the target (benchmarks/BENCHMARKS.md). Then the fix is fewer
  sequences at once, as many as a step holds within the target beside the prompt tokens a step must
  carry for that rate (its time's share c x prompt tokens a second), where that is fewer than ran;
  else the card is at its capacity for the target: the slo policy (refusing what it cannot serve in
  time) or more replicas.

Also: the share of steps launched ahead of the previous step's tokens (where CUDA graphs replay,
a step that is not waits for the host between steps), and how far the engine's own predictions
(the fit it scheduled with) were off.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from goodserve.diagnose.advisor import REPLICAS, Advice, Fix
from goodserve.engine.core.step_time_model import StepTimeFit, StepTimeModel
from goodserve.engine.core.step_trace import read_step_trace
from goodserve.errors import InvalidRequestError

# Below this share of the decode tokens in steps over the target, TPOT misses are not the steps'.
MIN_TOKENS_OVER = 0.05
# Where CUDA graphs replay, fewer steps than this launched ahead: the host sits between steps.
MIN_RAN_AHEAD = 0.8


@dataclass
class StepsReport:
    steps: int
    seconds: float  # from the first step recorded to the last
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    target_ms: float  # the TPOT target the steps are held against
    over_target: int  # steps that outlasted it
    tokens_over_target: float  # the share of decode tokens those steps delivered
    over_by_batch: int  # of them, those whose decode rows alone outlast the target (by the fit)
    over_by_prompts: int  # those the prompt tokens mixed in pushed over
    graph_share: float  # steps that replayed a CUDA graph
    ran_ahead_share: float  # of those, steps launched before the previous one's tokens reached the host
    prediction_error: float | None  # the median |measured - predicted| / predicted of the engine's own predictions
    fit: StepTimeFit | None  # the trace's steps, fitted
    max_rows_within: int | None  # decode rows (at the trace's mean context a row) a step fits within the target
    # the step budget (decode rows and prompt tokens) that fits the median over-target prompt step within
    # the target; and the prompt tokens a second it leaves at the largest batches, beside those the trace's
    # steps carried a second while prompts came
    max_batched_tokens_within: int | None
    prompt_room_per_s: float | None
    prompt_tokens_per_s: float
    max_rows_beside_prompts: int | None  # decode rows a step holds within the target beside that prompt rate
    max_decode_rows: int  # the most the trace's steps ran
    slo_policy: bool  # the engine ran the slo policy (its steps carry a prefill cap)


def analyze_steps(path: str, target_ms: float) -> StepsReport:
    try:
        steps = read_step_trace(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # missing, not JSON lines, not a trace's lines
        raise InvalidRequestError(f"cannot read the step trace {path}: {type(exc).__name__}: {exc}") from None
    if not steps:
        raise InvalidRequestError(f"the step trace {path} holds no steps")
    column = {name: np.array([float(step[name] or 0) for step in steps])
              for name in ("t", "decode_rows", "prompt_tokens", "context_tokens", "predicted_s", "measured_s")}
    measured_ms, rows = 1000 * column["measured_s"], column["decode_rows"]
    over = measured_ms > target_ms
    fit = _fit(steps)
    decode_ms = None if fit is None else 1000 * (fit.a + fit.b * rows + fit.d * column["context_tokens"])
    by_batch = over & (decode_ms > target_ms) if fit is not None else np.zeros_like(over)
    by_prompts = over & ~by_batch & (column["prompt_tokens"] > 0)
    graph = np.array([bool(step["graph"]) for step in steps])
    ran_ahead = np.array([bool(step["ran_ahead"]) for step in steps])
    predicted = column["predicted_s"] > 0
    error = np.abs(column["measured_s"] - column["predicted_s"])[predicted] / column["predicted_s"][predicted]
    return StepsReport(
        steps=len(steps), seconds=float(column["t"][-1] - column["t"][0]),
        p50_ms=float(np.percentile(measured_ms, 50)), p90_ms=float(np.percentile(measured_ms, 90)),
        p99_ms=float(np.percentile(measured_ms, 99)), max_ms=float(measured_ms.max()), target_ms=target_ms,
        over_target=int(over.sum()), tokens_over_target=float(rows[over].sum() / rows.sum()) if rows.sum() else 0.0,
        over_by_batch=int(by_batch.sum()), over_by_prompts=int(by_prompts.sum()),
        graph_share=float(graph.mean()), ran_ahead_share=float(ran_ahead[graph].mean()) if graph.any() else 0.0,
        prediction_error=float(np.median(error)) if len(error) else None, fit=fit,
        max_rows_within=_max_rows_within(fit, column, target_ms),
        **_step_budget_within(fit, column, by_prompts, target_ms), max_decode_rows=int(rows.max()),
        slo_policy=any(step["prefill_cap"] is not None for step in steps))


def _fit(steps: list[dict]) -> StepTimeFit | None:
    """The engine's step-time model over every step of the trace (no roofline priors: the steps say)."""
    model = StepTimeModel(window=len(steps), refit_every=len(steps) + 1)
    for step in steps:
        model.observe(step["decode_rows"], step["prompt_tokens"], step["context_tokens"], step["measured_s"])
    model.refit()
    return model.fit


def _max_rows_within(fit: StepTimeFit | None, column: dict, target_ms: float) -> int | None:
    rows = column["decode_rows"]
    if fit is None or not rows.sum():
        return None
    return fit.max_decode_rows(target_ms / 1000, float(column["context_tokens"].sum() / rows.sum()))


def _step_budget_within(fit: StepTimeFit | None, column: dict, by_prompts: np.ndarray, target_ms: float) -> dict:
    mixed = column["prompt_tokens"] > 0
    span = column["t"][mixed].max() - column["t"][mixed].min() if mixed.sum() > 1 else 0.0
    prompt_rate = float(column["prompt_tokens"].sum() / span) if span > 0 else 0.0
    report = {"max_batched_tokens_within": None, "prompt_room_per_s": None, "prompt_tokens_per_s": prompt_rate,
              "max_rows_beside_prompts": None}
    if fit is None or not by_prompts.any():
        return report
    # a step's share of time on the prompt tokens that rate brings: c x the rate
    decode_budget_s = target_ms / 1000 * max(1.0 - fit.c * prompt_rate, 0.0)
    rows_total = column["decode_rows"].sum()
    report["max_rows_beside_prompts"] = fit.max_decode_rows(
        decode_budget_s, float(column["context_tokens"].sum() / rows_total) if rows_total else 0.0)
    rows = round(float(np.median(column["decode_rows"][by_prompts])))
    context = float(np.median(column["context_tokens"][by_prompts]))
    budget = rows + fit.max_prefill_tokens(rows, target_ms / 1000, context)
    largest = column["decode_rows"] >= np.percentile(column["decode_rows"], 90)
    room = np.maximum(budget - column["decode_rows"][largest], 0).sum() / column["measured_s"][largest].sum()
    return {**report, "max_batched_tokens_within": int(budget), "prompt_room_per_s": float(room)}


def advise_steps(report: StepsReport) -> list[Advice]:
    """The steps' symptoms, ranked, each with the flags (and the values the trace supports) that fix it."""
    advice = []
    over = report.tokens_over_target >= MIN_TOKENS_OVER
    evidence = (f"{report.over_target} of {report.steps} steps over {report.target_ms:g} ms delivered "
                f"{100 * report.tokens_over_target:.0f}% of the decode tokens")
    slo = [] if report.slo_policy else [Fix(f"--scheduler-policy slo --slo-tpot-ms {report.target_ms:g}",
                                            "sizes the running batch and caps each step's prompt tokens from the "
                                            "fitted step time and the target, and refuses (429) what the queue "
                                            "cannot serve in time", "goodserve bench --goodput: attainment")]
    if over and report.over_by_batch >= report.over_by_prompts:
        advice.append(Advice(
            "decode steps outlast the TPOT target: the running batch is too large for it",
            report.tokens_over_target * 10,
            f"{evidence}; in {report.over_by_batch} of them the decode rows alone outlast it "
            f"(p99 step {report.p99_ms:.1f} ms)",
            [_fewer_rows(report), *slo]))
    if over and report.over_by_prompts > report.over_by_batch:
        # the slo policy lets a step outlast the target by what its decodes' earlier steps saved
        spent = "; the slo policy spends the slack its decodes saved on them" if report.slo_policy else ""
        budget, room = report.max_batched_tokens_within, report.prompt_room_per_s or 0.0
        starves = room < report.prompt_tokens_per_s
        fixes = _fewer_rows_or_replicas(report) if starves or not budget else [
            Fix(f"--max-num-batched-tokens {budget}",
                f"a step of the median such step's decode rows and the prompt tokens beside them fits the target by "
                f"the trace's fit, and at its largest batches leaves prompts {room:.0f} tokens/s (they needed "
                f"{report.prompt_tokens_per_s:.0f}): TTFT rises as prompts take more steps",
                "p99 TPOT falls and p99 TTFT stays within its target; if the waiting queue grows instead, undo it")]
        starved = (f"; a step budget within it ({budget} tokens) would leave prompts {room:.0f} tokens/s at the "
                   f"largest batches, fewer than the {report.prompt_tokens_per_s:.0f} they needed, and prefill would "
                   "fall behind") if starves else ""
        advice.append(Advice(
            "prompt chunks mixed into decode steps push them past the TPOT target",
            report.tokens_over_target * 10,
            f"{evidence}; in {report.over_by_prompts} of them the decode rows fit and the prompt tokens beside them "
            f"did not{spent}{starved}", [*fixes, *slo]))
    if report.graph_share > 0.5 and report.ran_ahead_share < MIN_RAN_AHEAD:
        advice.append(Advice(
            "steps wait on the host: few launch ahead of the previous step's tokens",
            (MIN_RAN_AHEAD - report.ran_ahead_share) * 5,
            f"{100 * report.ran_ahead_share:.0f}% of the steps that replayed a CUDA graph launched ahead",
            [Fix("--max-num-batched-tokens (at least the usual prompt)",
                 "a step with an unfinished prompt chunk cannot launch the next ahead; prompts that finish in one "
                 "step leave none", "the trace's ran_ahead share rises"),
             Fix("requests without penalties, logprobs, stop strings or min_tokens where they are not needed",
                 "their sampling needs the host each step, so a batch holding one runs synchronously",
                 "the trace's ran_ahead share rises")]))
    return sorted(advice, key=lambda a: -a.severity)


def _fewer_rows(report: StepsReport) -> Fix:
    """--max-num-seqs at what the trace's fit says fits the target; where not even one row does, a
    faster step (no batch limit can bring it within)."""
    rows = report.max_rows_within
    if rows is None or rows < 1:
        return Fix("a faster decode step: --quantization int4 / gguf, a faster device, or a looser target",
                   f"by the trace's fit even one decode row at this run's mean context outlasts "
                   f"{report.target_ms:g} ms, "
                   "so no --max-num-seqs brings steps within it", "the trace's p50 step falls under the target")
    return Fix(f"--max-num-seqs {rows}",
               f"a decode step of {rows} rows at this run's mean context fits {report.target_ms:g} ms by the trace's "
               "fit; the rest wait (or are refused) instead of slowing every stream",
               "p99 TPOT within the target; the trace's steps over it fall to ~0")


def _fewer_rows_or_replicas(report: StepsReport) -> list[Fix]:
    """Where no step budget fits the target and leaves the prompts their rate: fewer sequences at once,
    if fewer than ran would fit beside that rate; else the card is at its capacity for the target."""
    rows = report.max_rows_beside_prompts
    if rows is not None and 0 < rows < report.max_decode_rows:
        return [Fix(f"--max-num-seqs {rows}",
                    f"a decode step of {rows} rows and its share of {report.prompt_tokens_per_s:.0f} prompt tokens/s "
                    f"fits {report.target_ms:g} ms by the trace's fit (up to {report.max_decode_rows} ran); the rest "
                    "wait (or are refused)", "p99 TPOT within the target; the trace's steps over it fall")]
    return [Fix(REPLICAS, "this device is at its capacity for the target at this load: R engines share the arrivals",
                "goodserve bench --goodput-capacity rises about R x", "replicas")]
