"""goodserve tune on the GPU: dummy llama-3.1-8b (random bf16 weights, so the quality gate is off and
tune says so), the ShareGPT-like workload, TTFT <= 200 ms and TPOT <= 50 ms, within a 10-minute
budget. Its first trial is the default configuration's goodput capacity, measured the same way
(bench's in-process runner and capacity search), so the ratio of the winner's capacity to it is
the number to report; the target is >= 1.3x, or tune's own account of why the default stays best.

    python benchmarks/gpu_tune.py                       # ~10 minutes on an H100
    python benchmarks/gpu_tune.py --budget-minutes 8    # inside a 10-minute command limit

Each capacity probe sends --num-prompts requests (1,000 by default): a ShareGPT-like request lives
several seconds on the GPU, so a probe of 200 ends before its rate holds (every rate passes until
the all-at-once run, and bench warns the capacity is only the rate the probe sustained). A probe
of 1,000 at ~50 req/s lasts ~20 s plus ~14 s of drain; the capacity is the offered rate of the best
passing probe that held it, so the drain no longer lowers it.
    # real weights, where the quality gate means something (the embedded model's GGUF file, dequantized
    # to bf16 on CUDA unless a step keeps its codes):
    python benchmarks/gpu_tune.py --model smollm2-135m --budget-minutes 8 --output-dir tune-gpu-smollm2

The trial log in --output-dir makes a second call resume where the first stopped (the same flags).
Writes benchmarks/results/gpu_tune_<gpu>.json: the default's and the winner's capacity, the ratio,
the winning serve command, and every trial with why it was tried, what became of it, how long it
took, and its probes (offered, completed and sustained req/s, SLO attainment, seconds).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from goodserve.cli import main as goodserve
from goodserve.tune.report import headroom_note


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--workload", default="sharegpt")
    p.add_argument("--slo-ttft-ms", type=float, default=200.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--budget-minutes", type=float, default=10.0)
    p.add_argument("--num-prompts", type=int, default=1000, help="requests per capacity probe")
    p.add_argument("--capacity-bisections", type=int, default=1)
    p.add_argument("--gpu-hourly-cost", type=float, default=2.5, help="$ per GPU-hour (cost per 1M tokens)")
    p.add_argument("--output-dir", default="tune-gpu")
    p.add_argument("--result", help="default: benchmarks/results/gpu_tune_<gpu>.json")
    return p.parse_args()


def main() -> None:
    import torch

    args = parse_args()
    started = time.monotonic()
    status = goodserve(["tune", "--model", args.model, "--workload", args.workload,
                        "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms),
                        "--budget-minutes", str(args.budget_minutes), "--num-prompts", str(args.num_prompts),
                        "--capacity-bisections", str(args.capacity_bisections),
                        "--gpu-hourly-cost", str(args.gpu_hourly_cost), "--output-dir", args.output_dir,
                        "--no-progress"])
    tune_json = Path(args.output_dir) / "tune.json"
    if not tune_json.exists():  # the start failed: its error is the trial log's one trial
        raise SystemExit(f"tune exited {status} without a result: see {Path(args.output_dir) / 'trials.jsonl'}")
    tune = json.loads(tune_json.read_text())
    default = next(t for t in tune["trials"] if t["move"] == "start")
    winner = next(t for t in tune["trials"] if t["options"] == tune["winner"])
    ratio = winner["capacity"] / default["capacity"] if default.get("capacity") else None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {
        "gpu": gpu, "model": args.model, "workload": args.workload,
        "slos_ms": {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}, "budget_minutes": args.budget_minutes,
        "wall_minutes": (time.monotonic() - started) / 60, "exit_status": status,
        "default_capacity_req_s": default.get("capacity"), "winner_capacity_req_s": winner["capacity"],
        "ratio": ratio, "meets_1_3x": ratio is not None and ratio >= 1.3, "serve_command": tune["serve_command"],
        "default_headroom": headroom_note(default),
        "winner_headroom": None if winner is default else headroom_note(winner, default.get("capacity")),
        "stop_reason": tune["stop_reason"], "rounds": tune["rounds"],
        "trials": [{k: t.get(k) for k in ("move", "why", "predicted", "status", "capacity", "cost_per_1m_tokens",
                                          "seconds", "error", "probes", "capacity_warnings")}
                   | {f"p90_{slo}_ms": (t.get("at_capacity") or {}).get(f"p90_{slo}_ms") for slo in ("ttft", "tpot")}
                   for t in tune["trials"]],
    }
    slug = gpu.lower().replace("nvidia ", "").replace(" ", "_")
    path = Path(args.result or f"benchmarks/results/gpu_tune_{slug}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("trials", "rounds")}, indent=2))
    print(f"written {path}")


if __name__ == "__main__":
    main()
