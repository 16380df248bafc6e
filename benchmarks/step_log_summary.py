"""What a probe's steps add up to, from a step log `gpu_slo.py --step-log` wrote (plain or .gz):
per probe, the steps, the share carrying prompt tokens, their measured seconds in all, the mean step
a decode token waited for (steps weighted by their decode rows) beside the fit's prediction, the
step-time percentiles and the steps over --over-ms.

    python benchmarks/step_log_summary.py results/gpu_slo_sustained_51_57_steps_slo_1024_h200.json.gz

Writes $OUT/<log name>_summary.json (benchmarks/result_file.py).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from result_file import write_result  # noqa: E402


def probe_summary(rows: list, fields: list[str], over_ms: float) -> dict:
    column = {name: np.array([row[i] or 0.0 for row in rows], dtype=float) for i, name in enumerate(fields)
              if name != "path"}
    measured, predicted = 1000 * column["measured_s"], 1000 * column["predicted_s"]
    rows_weight = column["decode_rows"]
    return {"steps": len(rows), "share_with_prompt_tokens": float(np.mean(column["prompt_tokens"] > 0)),
            "measured_s_total": float(measured.sum() / 1000),
            "row_weighted_mean_ms": float((measured * rows_weight).sum() / rows_weight.sum()),
            "row_weighted_predicted_ms": float((predicted * rows_weight).sum() / rows_weight.sum()),
            **{f"p{q}_ms": float(np.percentile(measured, q)) for q in (50, 90, 99)},
            "max_ms": float(measured.max()), f"steps_over_{over_ms:g}_ms": int((measured > over_ms).sum())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log")
    p.add_argument("--over-ms", type=float, default=50.0)
    args = p.parse_args()
    with (gzip.open if args.log.endswith(".gz") else open)(args.log, "rt") as f:
        log = json.load(f)
    bounds = [*log["probe_first_rows"], len(log["rows"])]
    probes = [probe_summary(log["rows"][start:stop], log["fields"], args.over_ms)
              for start, stop in zip(bounds, bounds[1:])]
    for i, probe in enumerate(probes):
        print(f"probe {i}: " + ", ".join(f"{k} {v:.3g}" for k, v in probe.items()))
    name = os.path.basename(args.log).removesuffix(".gz").removesuffix(".json")
    print(f"wrote {write_result(f'{name}_summary.json', {'log': args.log, 'probes': probes})}")


if __name__ == "__main__":
    main()
