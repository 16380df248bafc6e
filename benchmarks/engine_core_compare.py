"""No speed lost to the engine core's reshaping (issue 14): the previous commit's engine and this
one on the same card, in one device call.

Each version runs its own benchmarks/gpu_engine.py (`--parts decode,int8,sharegpt`: batch-1 decode
of dummy llama-3.1-8b in bf16 and int8, and the ShareGPT-like offline batch of 500 requests) in a
fresh process, one after the other (--order; a second call in the other order shows whether a
drifting card favoured the version that ran first). A run takes 3-4 minutes on an H100.

    git archive <previous commit> | tar -x -C .prev    # src/ and benchmarks/ of the previous commit
    python benchmarks/engine_core_compare.py --previous .prev --order previous,current

Writes $OUT/engine_core_compare_<first>_first.json: each run's numbers and current / previous.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from result_file import write_result

PARTS = "decode,int8,sharegpt"
METRICS = {  # name -> path into gpu_engine.json
    "decode_bf16_tok_s": ("decode", "decode_tok_s"),
    "decode_int8_tok_s": ("decode_int8", "decode_tok_s"),
    "sharegpt_offline_output_tok_s": ("throughput_sharegpt_like", "output_tok_s"),
}


def run_version(root: Path, out: Path) -> dict:
    """One version's gpu_engine.py in a process of its own, importing that version's goodserve."""
    env = dict(os.environ, OUT=str(out), PYTHONPATH=f"{root / 'src'}:{root / 'benchmarks'}")
    start = time.perf_counter()
    subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_engine.py"), "--parts", PARTS],
                   cwd=root, env=env, check=True)
    results = json.loads((out / "gpu_engine.json").read_text())
    metrics = {name: results.get(part, {}).get(key) for name, (part, key) in METRICS.items()}
    return {"seconds": time.perf_counter() - start, "card": results.get("card"), **metrics,
            "errors": {k: v for k, v in results.items() if k.endswith("_error")}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--previous", required=True, help="a checkout of the previous commit")
    parser.add_argument("--order", default="previous,current")
    args = parser.parse_args()
    roots = {"previous": Path(args.previous).resolve(), "current": Path.cwd()}
    order = args.order.split(",")
    out_dir = Path(os.environ.get("OUT", "out"))
    runs = {version: run_version(roots[version], out_dir / version) for version in order}
    result = {"card": runs["current"]["card"], "model": "dummy:llama-3.1-8b", "parts": PARTS, "order": order,
              "runs": runs, "current_over_previous": {
                  name: runs["current"][name] / runs["previous"][name] if runs["previous"][name] else None
                  for name in METRICS}}
    print(json.dumps(result["current_over_previous"], indent=1))
    write_result(f"engine_core_compare_{order[0]}_first.json", result)


if __name__ == "__main__":
    main()
