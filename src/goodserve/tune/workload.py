"""What `goodserve tune --workload` names, as the flags of a bench run: a profile, a dataset file,
or a recording of real traffic (`goodserve serve --record-requests FILE`).

A recording is a JSONL file whose lines carry `arrival_s`; its prompts are kept (`prompt`) or
hashed (`prompt_sha256` and `prompt_tokens`: bench then sends text of that length, the same for
the same hash, so repeated prompts still repeat). Its inter-arrival gaps set the burstiness of
every probe (a gamma fit: shape = 1 / CV^2 of the gaps), its prompts the mix each probe sends.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from goodserve.bench.workloads import jsonl_rows
from goodserve.errors import InvalidRequestError

PROFILES = {
    "sharegpt": ["--dataset-name", "sharegpt"],
    "long-prompt": ["--dataset-name", "random", "--random-input-len", "4096", "--random-output-len", "256",
                    "--random-range-ratio", "0.25"],
    "prefix-heavy": ["--dataset-name", "prefix_repetition"],
    "copy": ["--dataset-name", "copy", "--random-input-len", "512", "--random-output-len", "512"],
    "chat": ["--dataset-name", "multiturn"],
    "random": ["--dataset-name", "random"],
}
ALIASES = {"sharegpt-like": "sharegpt"}
# Bench flags a --output-len / --input-len sets, whichever dataset reads them.
OUTPUT_LEN_FLAGS = ("--random-output-len", "--sharegpt-output-len", "--prefix-repetition-output-len",
                    "--custom-output-len")
BURSTINESS_RANGE = (0.05, 20.0)


def bench_workload_argv(workload: str, input_len: int | None = None, output_len: int | None = None) -> list[str]:
    """The bench flags of a workload; a file that does not exist, or an unknown name, is refused here."""
    name = ALIASES.get(workload, workload)
    if name in PROFILES:
        argv = list(PROFILES[name])
    else:
        argv = _file_argv(Path(workload))
    if input_len is not None:
        argv += ["--random-input-len", str(input_len), "--prefix-repetition-suffix-len", str(input_len)]
    if output_len is not None:
        argv += [arg for flag in OUTPUT_LEN_FLAGS for arg in (flag, str(output_len))]
    return argv


def _file_argv(path: Path) -> list[str]:
    if not path.is_file():
        raise InvalidRequestError(f"--workload {path}: neither a profile ({', '.join(PROFILES)}) nor a file")
    if path.suffix == ".json":
        return ["--dataset-name", "sharegpt", "--dataset-path", str(path)]
    argv = ["--dataset-name", "custom", "--dataset-path", str(path)]
    arrivals = recorded_arrivals(path)
    return argv + (["--burstiness", f"{recorded_burstiness(arrivals):.4g}"] if len(arrivals) > 2 else [])


def recorded_arrivals(path: Path) -> list[float]:
    """The arrival_s of each line that has one (none: a dataset file, not a recording)."""
    arrivals = []
    for _, row in jsonl_rows(path):
        if isinstance(row, dict) and isinstance(row.get("arrival_s"), (int, float)):
            arrivals.append(float(row["arrival_s"]))
    return arrivals


def recorded_burstiness(arrivals: list[float]) -> float:
    """Gamma shape of the gaps between arrivals: 1 for Poisson traffic, < 1 burstier, > 1 more even."""
    gaps = np.diff(np.sort(np.asarray(arrivals)))
    if gaps.mean() <= 0:
        return BURSTINESS_RANGE[0]  # every request at once: as bursty as bench goes
    cv2 = gaps.var() / gaps.mean() ** 2
    return float(np.clip(1.0 / cv2 if cv2 > 0 else BURSTINESS_RANGE[1], *BURSTINESS_RANGE))
