"""The engine's output phase a step, cumulative outputs against deltas (SamplingParams.output_kind).

A cumulative output copies every token a request has generated into each step's output, so the
phase grows with the answers' length; a delta copies what the step added. R requests (32-token
prompts, --max-tokens greedy tokens, ignore_eos) on dummy:tiny, each kind in a fresh engine with
the serving process's collector settings, the kinds alternated A B B A per run. Measured by the
engine's own phase timer (what /metrics serves as goodserve:step_time_seconds_total{phase="output"}),
over steps 100 to --max-tokens - 50, while every request decodes.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/cpu_output_phase.py [--rows 256] [--max-tokens 960]

Writes $OUT/cpu_output_phase.json (benchmarks/result_file.py).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from result_file import cpu_model_name, write_result  # noqa: E402

from goodserve.config import EngineConfig  # noqa: E402
from goodserve.engine.frontend.engine import Engine  # noqa: E402
from goodserve.engine.processes.gc_pauses import tune_for_serving  # noqa: E402
from goodserve.sampling_params import SamplingParams  # noqa: E402

PROMPT_LEN, FIRST_STEP = 32, 100


def output_phase_ms(kind: str, rows: int, max_tokens: int) -> float:
    """The output phase's mean ms a step over steps FIRST_STEP .. max_tokens - 50."""
    config = EngineConfig(model="dummy:tiny", device="cpu", max_num_seqs=rows, max_num_batched_tokens=16384,
                          num_kv_blocks=rows * (2 + (PROMPT_LEN + max_tokens) // 16), max_model_len=1024)
    engine = Engine(config)
    gc.collect()
    gc.freeze()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, output_kind=kind)
    for i in range(rows):
        engine.add_request(f"r{i}", [(i * 7 + j) % 500 + 1 for j in range(PROMPT_LEN)], params)
    last_step, marks = max_tokens - 50, {}
    while engine.has_unfinished():
        engine.step()
        if engine.steps.num_steps in (FIRST_STEP, last_step):
            marks[engine.steps.num_steps] = engine.steps.output
    gc.unfreeze()
    return 1000 * (marks[last_step] - marks[FIRST_STEP]) / (last_step - FIRST_STEP)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=960, help="each request's greedy tokens (the context is 1,024)")
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args()
    tune_for_serving()
    ms: dict[str, list[float]] = {"cumulative": [], "delta": []}
    for _ in range(args.runs):
        for kind in ("cumulative", "delta", "delta", "cumulative"):
            ms[kind].append(output_phase_ms(kind, args.rows, args.max_tokens))
            print(f"{kind:>10}: {ms[kind][-1]:.3f} ms a step", flush=True)
    result = {"cpu": cpu_model_name(), "rows": args.rows, "max_tokens": args.max_tokens,
              "output_phase_ms": ms, "median_ms": {kind: statistics.median(v) for kind, v in ms.items()}}
    result["delta_over_cumulative"] = result["median_ms"]["delta"] / result["median_ms"]["cumulative"]
    print(f"median: cumulative {result['median_ms']['cumulative']:.3f} ms, delta {result['median_ms']['delta']:.3f} ms "
          f"({result['delta_over_cumulative']:.2f}x)")
    print("wrote", write_result("cpu_output_phase.json", result))


if __name__ == "__main__":
    main()
