"""A batch job running beside a benchmark's online traffic, in the same in-process engine.

Its lines go the way the server's batch runner sends them (server/batch_lines.run_lines over a
ServingContext.for_batch view: the /v1/completions handler, BATCH_PRIORITY, a waiting-queue count
of their own, no latency targets), so the engine sees exactly what a `POST /v1/batches` job gives
it. The job need not finish: `window` counts the lines it completes, and their output tokens, while
a probe of online traffic runs.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from goodserve.bench.workloads import BenchRequest
from goodserve.engine.frontend.admission import Admission
from goodserve.server.batch_lines import ENDPOINTS, LineResult, parse_lines, run_lines
from goodserve.server.metrics import ServerMetrics, Slo
from goodserve.server.serving import ServingContext


def batch_input(requests: list[BenchRequest], prompts: list[str | list[int]], model: str) -> bytes:
    """An OpenAI batch input file (JSONL) of /v1/completions lines, one a request, answers of exactly
    its output_len tokens."""
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": prompt, "max_tokens": request.output_len,
                       "ignore_eos": True, "temperature": 0.0}}
             for i, (request, prompt) in enumerate(zip(requests, prompts))]
    return "\n".join(json.dumps(line) for line in lines).encode()


@dataclass
class BatchWindow:
    seconds: float
    lines: int = 0  # lines completed (status 200) in the window
    failed: int = 0
    output_tokens: int = 0  # of those lines

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "completed_lines": self.lines, "failed_lines": self.failed,
                "output_tokens": self.output_tokens,
                "output_tokens_per_s": self.output_tokens / self.seconds if self.seconds > 0 else 0.0}


@dataclass
class BatchJob:
    """start() the job, read window() spans while it runs, stop() it (lines in flight are aborted)."""

    engine: object  # AsyncEngine
    model: str
    data: bytes  # the batch input file
    max_concurrency: int
    finished: list[tuple[float, LineResult]] = field(default_factory=list)  # (perf_counter, result)
    _stopping: bool = False

    def start(self) -> None:
        lines = parse_lines(self.data, ENDPOINTS)
        online = ServingContext(self.engine, self.model, Admission(max_waiting=1 << 62),
                                ServerMetrics(self.engine, self.model, Slo()))
        self._ctx = online.for_batch(Admission(max_waiting=max(1024, self.max_concurrency)))
        self._task = asyncio.create_task(run_lines(self._ctx, lines, self.max_concurrency, self._record,
                                                   stopping=lambda: self._stopping))

    async def _record(self, result: LineResult) -> None:
        self.finished.append((time.perf_counter(), result))

    def window(self, start: float, end: float) -> BatchWindow:
        """The lines that finished between two perf_counter() readings."""
        window = BatchWindow(end - start)
        for at, result in self.finished:
            if start <= at <= end:
                if result.ok:
                    window.lines += 1
                    window.output_tokens += result.record["response"]["body"]["usage"]["completion_tokens"]
                else:
                    window.failed += 1
        return window

    @property
    def done(self) -> bool:
        return self._task.done()

    async def stop(self) -> None:
        """Stop taking lines and abort those in flight; raise what broke the job, if something did."""
        self._stopping = True
        self._task.cancel()
        [outcome] = await asyncio.gather(self._task, return_exceptions=True)
        self._ctx.close()
        if isinstance(outcome, Exception):  # the engine stopped, or a bug
            raise outcome
