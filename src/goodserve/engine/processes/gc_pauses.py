"""Garbage-collector pauses in a serving process.

Python's collector walks every tracked object of its oldest generation in one pass, and a process
that has imported torch and built a model holds a few hundred thousand of them (modules, functions,
parameters, captured graphs' keep-alives). Such a pass stops the engine thread, and every running
stream's next token with it: 122-166 ms on a 2-core CPU at 256-448 streams
(benchmarks/results/cpu_host_step_gc_freeze_intel.json). What exists once an engine is built lives
as long as it does, so it is moved out of the collector's reach (gc.freeze); a full pass then walks
only what came after (3-9 ms there). The server's engine, each worker process and a disaggregated
prefill worker freeze once built; the offline LLM does not: a program may build many, and a frozen
engine's reference cycles would outlive it. What pauses remain, the server serves as
goodserve:gc_pause_seconds (PauseLog). The serving process also collects its young objects less
often and hands the GIL over sooner than Python's defaults do (tune_for_serving): the engine thread
otherwise stalls behind the event loop and the young collections of its streams' objects.
"""

from __future__ import annotations

import atexit
import bisect
import gc
import os
import sys
import time

from goodserve.errors import InvalidRequestError

PAUSE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)  # seconds


def freeze_startup_heap() -> None:
    """Collect what startup left as garbage, then freeze every object alive now. At exit they are
    given back first: the interpreter's last collection skips frozen objects, and extensions that
    count their instances (Triton's nanobind types) report every one it leaves as leaked."""
    gc.collect()
    gc.freeze()
    atexit.unregister(unfreeze_heap)  # once, however many engines a process starts
    atexit.register(unfreeze_heap)


# The serving process's settings (benchmarks/results/gpu_host_share_gc_switch_h200.json: 8B on an
# H200 at 512 streams over HTTP, uvicorn on asyncio and h11: 6.0 K output tok/s with Python's, 7.0 K
# with this gen0 threshold alone, 8.1 K with both). Young collections come every 700 container
# allocations by Python's default, and a token's trip to its stream allocates dozens: they took
# 10-21% of the wall time.
SERVING_GC_GEN0_THRESHOLD = 20_000
# A thread that wants the GIL waits this long for the holder to yield it (Python's default: 5 ms).
# The engine thread gives the GIL up at every torch call, and the event loop, busy with many
# streams, kept it the whole interval each time.
SERVING_SWITCH_INTERVAL_S = 0.0005


def serving_settings() -> tuple[tuple[int, ...], float]:
    """(collector thresholds, switch interval in seconds): the settings above, or the environment's
    (GOODSERVE_GC_THRESHOLD "gen0[,gen1[,gen2]]", GOODSERVE_SWITCH_INTERVAL_MS); a value that is
    neither raises, naming the variable (the serve command checks before it starts)."""
    threshold = os.environ.get("GOODSERVE_GC_THRESHOLD", str(SERVING_GC_GEN0_THRESHOLD))
    interval_ms = os.environ.get("GOODSERVE_SWITCH_INTERVAL_MS", str(SERVING_SWITCH_INTERVAL_S * 1000))
    try:
        thresholds = tuple(int(value) for value in threshold.split(","))
        if not 1 <= len(thresholds) <= 3 or min(thresholds) < 0:
            raise ValueError
    except ValueError:
        raise InvalidRequestError(f"GOODSERVE_GC_THRESHOLD={threshold!r}: give gen0[,gen1[,gen2]], "
                                  "integers >= 0") from None
    try:
        interval_s = float(interval_ms) / 1000
        if not interval_s > 0:
            raise ValueError
    except ValueError:
        raise InvalidRequestError(f"GOODSERVE_SWITCH_INTERVAL_MS={interval_ms!r}: give a number of "
                                  "milliseconds above 0") from None
    return thresholds, interval_s


def tune_for_serving() -> None:
    """Apply serving_settings() to this process."""
    thresholds, interval_s = serving_settings()
    gc.set_threshold(*thresholds)
    sys.setswitchinterval(interval_s)


def unfreeze_heap() -> None:
    """Give the frozen objects back to the collector: an engine shut down in a process that goes on
    (a test, an embedding program) leaves cycles only a collection frees."""
    gc.unfreeze()


class PauseLog:
    """Every collection's duration, by generation, in PAUSE_BUCKETS (the server's
    goodserve:gc_pause_seconds). A collection can start inside any allocation, one made under a
    metrics library's lock included, so the callback only adds to plain lists: the GIL orders it, and
    collections never overlap."""

    def __init__(self) -> None:
        self.bucket_counts = [[0] * (len(PAUSE_BUCKETS) + 1) for _ in range(3)]  # the last: over 1 s
        self.seconds = [0.0] * 3
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        seconds, generation = time.perf_counter() - self._started, info["generation"]
        self.bucket_counts[generation][bisect.bisect_left(PAUSE_BUCKETS, seconds)] += 1
        self.seconds[generation] += seconds


PAUSES = PauseLog()


def watch_pauses() -> PauseLog:
    """This process's PauseLog, timing every collection from now on (once, however often asked)."""
    if PAUSES not in gc.callbacks:
        gc.callbacks.append(PAUSES)
    return PAUSES
