"""How many threads each of goodserve's processes computes with: from the cores this process may
really use (its CPU affinity, and a cgroup CPU quota, as a container sets one) and the processes
goodserve runs on them. Left alone, the server's process and the engine's each start an OpenMP pool
of every core the machine has: on a shared 2-core machine a 32-token request then took 1.0-16.3 s
run to run, and 0.41-0.55 s with one thread for the engine."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

_CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


@dataclass(frozen=True)
class Cores:
    count: int  # cores this process may use: the smaller of its affinity and its cgroup quota
    affinity: int
    quota: float | None  # the cgroup's CPU quota in cores; None: no quota

    def describe(self) -> str:
        quota = "none" if self.quota is None else f"{self.quota:g}"
        return f"{self.count} cores usable (CPU affinity {self.affinity}, cgroup quota {quota})"


def cgroup_quota(v2: Path = _CGROUP_V2, v1: tuple[Path, Path] = _CGROUP_V1) -> float | None:
    """The CPU quota in cores ("200000 100000" in cpu.max is 2), or None where there is none."""
    try:
        quota, period = v2.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota, period = int(v1[0].read_text()), int(v1[1].read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def available_cores() -> Cores:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_quota()
    count = affinity if quota is None else max(1, min(affinity, math.floor(quota)))
    return Cores(count, affinity, quota)


@dataclass(frozen=True)
class ThreadPlan:
    engine: int  # threads each engine rank computes with
    server: int  # threads of the serving process's own pool (it computes nothing when the engine has a process)
    cores: Cores
    source: str  # why: the cores and the processes, or the user's OMP_NUM_THREADS

    def describe(self) -> str:
        return (f"CPU threads: {self.engine} per engine rank, {self.server} for the server's process; "
                f"{self.cores.describe()}; {self.source}")


def plan_threads(engine_process: bool, world_size: int, cores: Cores | None = None,
                 environ: dict[str, str] | None = None) -> ThreadPlan:
    """The engine's ranks share the cores but one, which the server's event loop keeps (with the
    engine in the server's process, that core is its thread's); an OMP_NUM_THREADS the user set wins."""
    cores = cores or available_cores()
    given = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return ThreadPlan(int(given), 1 if engine_process else int(given), cores, "OMP_NUM_THREADS as set")
    engine = max(1, (cores.count - 1) // world_size)
    processes = f"{world_size} engine rank{'s' if world_size > 1 else ''}"
    return ThreadPlan(engine, 1 if engine_process else engine, cores,
                      f"one core kept for the server's event loop, the rest shared by {processes}")


def apply_thread_plan(plan: ThreadPlan) -> None:
    """Before the engine starts: its processes read OMP_NUM_THREADS as they import torch; this process
    sets its own pool now."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(plan.engine)
    torch.set_num_threads(plan.server)
