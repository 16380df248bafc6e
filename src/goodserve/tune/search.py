"""The loop: from the starting configuration, take the step the roofline predicts helps most,
measure it, keep it if goodput capacity rose and quality held, diagnose again, repeat.

Not a grid: each round plans from the configuration kept so far and the bottleneck its own
probes show, so a step that stops paying once another is kept (int4 after GGUF codes) is not
tried. Measuring is the caller's (measure.py on an engine; recorded numbers in the tests); the
trial log makes an interrupted search resume where it stopped, replaying its decisions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from goodserve.errors import GoodserveError
from goodserve.tune.bottleneck import Bottleneck
from goodserve.tune.space import Step, options_key, plan
from goodserve.tune.trial_log import TrialLog

# A kept step must raise capacity by this much: less is within a probe's noise.
MIN_GAIN = 0.03

# (options, move, why, predicted factor on the best capacity so far, None: no prediction) -> trial
Measure = Callable[[dict, str, str, float | None], dict]
Diagnose = Callable[[dict], Bottleneck]  # a measured trial -> its bottleneck


@dataclass
class Budget:
    seconds: float
    clock: Callable[[], float] = time.monotonic
    start: float = field(init=False)

    def __post_init__(self) -> None:
        self.start = self.clock()

    def left(self) -> float:
        return self.seconds - (self.clock() - self.start)


@dataclass
class Outcome:
    trials: list[dict]
    best: dict  # the configuration kept last: the winner
    skipped: list[dict]  # {"step", "why", "round"}
    rounds: list[dict]  # per round: the configuration planned from and its bottleneck
    stop_reason: str


def accepted(trial: dict) -> bool:
    """Measured, and within the quality budget (or the budget could not apply: random weights)."""
    return trial.get("capacity") is not None and trial["quality"].get("passed", True)


def verdict(trial: dict, best: dict) -> str:
    if trial.get("error"):
        return "failed"
    if not trial["quality"].get("passed", True):
        return "rejected: quality"
    if trial["capacity"] > best["capacity"] * (1 + MIN_GAIN):
        return "kept"
    return "no gain"


class Search:
    def __init__(self, measure: Measure, diagnose: Diagnose, log: TrialLog, budget: Budget,
                 max_trials: int | None = None, forced: list[dict] | None = None,
                 on_event: Callable[[str], None] = lambda text: None):
        self.measure, self.diagnose, self.log = measure, diagnose, log
        self.budget, self.max_trials = budget, max_trials
        self.forced = list(forced or [])  # options the user asked to try first (--try)
        self.say = on_event
        self.trials: list[dict] = []
        self.skipped: list[dict] = []
        self.rounds: list[dict] = []

    def trial(self, options: dict, move: str, why: str, predicted: float | None = None) -> dict:
        """A recorded trial from the log (resuming), else a new measurement, logged as it lands."""
        recorded = self.log.get(options_key(options))
        if recorded is not None:
            self.say(f"resumed from the trial log: {move}")
            trial = recorded
        else:
            self.say(f"trial {len(self.trials) + 1}: {move} ({why}); {self.budget.left() / 60:.1f} min left")
            started = self.budget.clock()
            trial = {**self.measure(options, move, why, predicted), "options": options, "move": move, "why": why,
                     "predicted": predicted}
            trial["seconds"] = self.budget.clock() - started
            self.log.append(options_key(options), trial)
        self.trials.append(trial)
        return trial

    def run(self, start: dict) -> Outcome:
        best = self.trial(start, "start", "the configuration given")
        best["status"] = "start"
        if best.get("capacity") is None:
            why = best.get("error") or (f"past the quality budget against the unoptimized model "
                                        f"({best['quality'].get('summary')}): start from one within it")
            return Outcome(self.trials, best, self.skipped, self.rounds, f"the starting configuration failed: {why}")
        while True:
            stop = self._out_of_budget()
            if stop:
                return Outcome(self.trials, best, self.skipped, self.rounds, stop)
            try:
                step, options = self._next_step(best)
            except GoodserveError as exc:  # nothing to diagnose: no request of its probes completed
                return Outcome(self.trials, best, self.skipped, self.rounds, f"cannot diagnose {best['move']}: {exc}")
            if step is None:
                return Outcome(self.trials, best, self.skipped, self.rounds,
                               "no step left that the roofline predicts helps")
            trial = self.trial(options, step.name, step.why, step.predicted)
            trial["status"] = verdict(trial, best)
            self.say(f"  {trial['status']}: {describe(trial)}")
            if trial["status"] == "kept":
                best = trial

    def _out_of_budget(self) -> str | None:
        if self.max_trials is not None and len(self.trials) >= self.max_trials:
            return f"--max-trials {self.max_trials} reached"
        measured = [t["seconds"] for t in self.trials if t.get("seconds")]
        typical = sum(measured) / len(measured) if measured else 0.0
        if self.budget.left() < typical:
            return (f"budget: {max(self.budget.left(), 0) / 60:.1f} min left, a trial takes ~{typical / 60:.1f} min")
        return None

    def _next_step(self, best: dict) -> tuple[Step | None, dict]:
        tried = {options_key(t["options"]) for t in self.trials}
        while self.forced:
            options = {**best["options"], **self.forced.pop(0)}
            if options_key(options) not in tried:
                changes = {k: v for k, v in options.items() if best["options"].get(k) != v}
                return Step(changes, None, "asked for with --try"), options
        bottleneck = self.diagnose(best)
        to_try, skipped = plan(best["options"], bottleneck, tried)
        self.rounds.append({"from": best["move"], "bottleneck": bottleneck.summary()})
        self.say(f"bottleneck of {best['move']}: {bottleneck.summary()}")
        for step, why in skipped:
            self.skipped.append({"step": step.name, "why": why, "round": len(self.rounds)})
            self.say(f"  skipped {step.name}: {why}")
        return to_try[0] if to_try else (None, {})


def describe(trial: dict) -> str:
    if trial.get("error"):
        return trial["error"]
    quality = trial["quality"]
    text = quality.get("summary", "")
    if trial.get("capacity") is None:
        return text
    return f"goodput capacity {trial['capacity']:.3g} req/s" + (f"; {text}" if text else "")


def ranked(trials: list[dict]) -> list[dict]:
    """Accepted trials by capacity, best first; then the rejected and failed ones."""
    good = sorted((t for t in trials if accepted(t)), key=lambda t: -t["capacity"])
    return good + [t for t in trials if not accepted(t)]
