"""Quality of every lossy option on one model, measured by the `goodserve eval` gate's metrics.

Runs the unoptimized baseline once, then each candidate configuration on the same workload, and
writes benchmarks/results/quant_quality_<model>.json (docs/quantization.md quotes it).
Usage: python benchmarks/quant_quality.py [--model smollm2-135m] [--max-text-tokens 4096]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
from pathlib import Path

import torch

from goodserve.commands.quality_gate import (BASELINE_OPTIONS, EvalSettings, checks, compare, default_thresholds,
                                             measure)
from goodserve.config import EngineConfig

INT4_G64 = {"quantization": "int4", "quantization_group_size": 64}
INT4_G32 = {"quantization": "int4", "quantization_group_size": 32}
AWQ = {"quantization_awq": True}
CANDIDATES = {  # name: engine options; smollm2's hidden size 576 rules out group 128
    "int8 weights": {"quantization": "int8"},
    "fp8 weights and activations": {"quantization": "fp8"},
    "int4 weights, group 64": INT4_G64,
    "int4 weights, group 64, AWQ": {**INT4_G64, **AWQ},
    "int4 weights, group 32": INT4_G32,
    "int4 weights, group 32, AWQ": {**INT4_G32, **AWQ},
    "int8 KV cache": {"kv_cache_dtype": "int8"},
    "int8 weights + int8 KV cache": {"quantization": "int8", "kv_cache_dtype": "int8"},
    "default engine (prefix caching, auto backend)": {},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-text-tokens", type=int, default=4096)
    parser.add_argument("--output", default=None)
    parser.add_argument("--only", nargs="*", help="candidate names to run (default: all)")
    args = parser.parse_args()
    settings = EvalSettings(max_text_tokens=args.max_text_tokens)
    base_config = dataclasses.replace(EngineConfig(model=args.model, device=args.device), **BASELINE_OPTIONS)
    workload, baseline = measure(base_config, settings)
    results = {}
    selected = set(args.only or CANDIDATES)
    for name, options in CANDIDATES.items():
        if name not in selected:
            continue
        candidate = dataclasses.replace(EngineConfig(model=args.model, device=args.device), **options)
        _, run = measure(candidate, settings, workload)
        metrics = compare(baseline, run)
        rows = checks(metrics, default_thresholds(candidate))
        results[name] = {"options": options, "metrics": metrics, "checks": rows,
                         "passed": all(r["passed"] for r in rows), "seconds": run.seconds}
        print(f"{name}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
    report = {
        "model": args.model,
        "machine": {"processor": platform.processor() or platform.machine(),
                    "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                    "torch": torch.__version__},
        "text": {"source": workload.text_source, "windows": len(workload.windows),
                 "scored_tokens": sum(len(w) - 1 for w in workload.windows)},
        "greedy": {"prompts": len(workload.prompts), "max_new_tokens": settings.max_new_tokens},
        "baseline": {"options": BASELINE_OPTIONS, "seconds": baseline.seconds},
        "candidates": results,
    }
    safe_name = args.model.replace("/", "_").replace(":", "_")
    output = Path(args.output or Path(__file__).parent / "results" / f"quant_quality_{safe_name}.json")
    output.write_text(json.dumps(report, indent=2))
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
