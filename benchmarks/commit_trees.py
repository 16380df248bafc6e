"""Several commits' src/ side by side, for benchmarks that time versions in one run: `git archive`
of each into a temporary directory, which a child process then imports (PYTHONPATH=tree/src)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def commit_trees(commits: list[str]):
    """commit -> a directory holding that commit's src/, for the block's length. A LABEL=DIR entry is
    a tree already extracted (where there is no git: a GPU machine gets the working tree only)."""
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for commit in commits:
            if "=" in commit:
                trees[commit] = Path(commit.split("=", 1)[1]).resolve()
                continue
            trees[commit] = Path(tmp) / commit.replace("/", "_")
            trees[commit].mkdir()
            archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "src"], capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(trees[commit])], input=archive.stdout, check=True)
        yield trees


def cpu_machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "?")
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split()
    return {"model_name": name, "cores": os.cpu_count(), "avx2": "avx2" in flags, "avx512f": "avx512f" in flags}
