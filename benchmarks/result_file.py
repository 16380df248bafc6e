"""Where a benchmark's JSON result goes: $OUT (the device tool's folder that comes back) or ./out; and the
facts about the host a result records (its GPUs, a process's CPU time)."""

from __future__ import annotations

import json
import os
import platform
import subprocess


def write_result(name: str, result) -> str:
    """result as indented JSON in $OUT/name (./out/name without OUT); returns the path."""
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def cpu_model_name() -> str:
    """The host's CPU as /proc/cpuinfo names it (where there is none, what platform knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def gpu_names() -> list[str]:
    """The host's GPUs by name, from nvidia-smi: a driver process that serves through others keeps no
    CUDA context of its own (one would take memory on GPU 0 before the servers size their pools)."""
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in listed.splitlines() if line.strip()]


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far (Linux /proc): one Python process near a core of it
    (a router, a load generator) limits what it serves or measures."""
    return _stat_cpu_seconds(f"/proc/{pid}/stat")


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """The same, split: the process's main thread (a server's event loop) and its other threads (its
    engine thread and helpers), whose sum one GIL keeps near a core."""
    seconds = {"main_thread": 0.0, "other_threads": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            cpu = _stat_cpu_seconds(f"/proc/{pid}/task/{tid}/stat")
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        seconds["main_thread" if int(tid) == pid else "other_threads"] += cpu
    return seconds


def _stat_cpu_seconds(path: str) -> float:
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
