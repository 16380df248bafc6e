"""One line of JSON per step (--step-trace FILE): what a run's steps were, to read afterwards.

Why a step took as long as it did is the question behind most TPOT misses, and aggregates hide it:
a mean step of 15 ms says nothing of the bursts of 60 ms ones. Per step: when it was recorded (`t`,
the wall clock), its shape (decode rows, prompt tokens, the context its decode rows read), whether
it replayed a CUDA graph and whether it was launched before the previous step's tokens reached the
host (`ran_ahead`), the step-time model's prediction for it before it ran (null until the model has
a fit) and what it took (`measured_s`: the interval at which its decodes got their tokens, as the
model measures it), and the queue around it: running and waiting sequences, the prompt tokens the
scheduler allowed beside the decodes (`prefill_cap`), and the decode rows of requests with latency
targets (`targeted_decode_rows`; the rest are batch lines or requests without targets).

Written by the engine, in whichever process runs it (`serve` runs it in its own), line-buffered, so
a run that dies keeps its steps. benchmarks/gpu_slo.py --step-log and step_log_summary.py read it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from goodserve.engine.seam.scheduler_output import SchedulerOutput
from goodserve.engine.core.slo_policy import has_targets
from goodserve.engine.core.step_time_model import decode_rows_of

if TYPE_CHECKING:  # diagnose reads traces without the engine's torch
    from goodserve.engine.core.scheduler import Scheduler


class StepTrace:
    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the engine's life

    def record(self, out: SchedulerOutput, shape: tuple[int, int, int], wall_time: float, measured_s: float,
               graph: bool, ran_ahead: bool, scheduler: Scheduler) -> None:
        """shape: step_shape(out). Called before the step-time model observes the step, so `predicted_s`
        is the prediction the scheduler planned with."""
        decode_rows, prompt_tokens, context_tokens = shape
        fit = scheduler.step_time.fit
        decodes = [out.seq_ids[row] for row in decode_rows_of(out)]
        predicted = None if fit is None else round(fit.seconds(decode_rows, prompt_tokens, context_tokens), 6)
        line = {"t": round(wall_time, 6), "decode_rows": decode_rows, "prompt_tokens": prompt_tokens,
                "context_tokens": context_tokens, "predicted_s": predicted,
                "measured_s": round(measured_s, 6), "graph": graph, "ran_ahead": ran_ahead,
                "running": len(scheduler.running), "waiting": len(scheduler.waiting),
                "prefill_cap": scheduler.policy.prefill_cap,
                "targeted_decode_rows": sum(seq_id in scheduler.seqs and has_targets(scheduler.seqs[seq_id])
                                            for seq_id in decodes)}
        self.file.write(json.dumps(line) + "\n")


def read_step_trace(path: str, since: float = 0.0, until: float = float("inf")) -> list[dict]:
    """The steps a trace recorded between two wall-clock times."""
    with open(path) as f:
        return [step for step in map(json.loads, f) if since <= step["t"] < until]
