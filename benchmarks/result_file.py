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
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
