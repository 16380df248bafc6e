"""No speed lost to the engine core's reshaping: the previous commit's engine and this
one on the same machine, each version in fresh processes importing its own goodserve.

GPU (default): each version runs its own benchmarks/gpu_engine.py (`--parts decode,int8,sharegpt`:
batch-1 decode of dummy llama-3.1-8b in bf16 and int8, and the ShareGPT-like offline batch of 500
requests), then its own benchmarks/gpu_spec_decode.py `--parts copy` (the embedded model in float32
on bench's copy workload, ngram k = 4 at batch 1 and 4, and whether greedy outputs stay those of
speculation off: it needs the embedded model's package on PYTHONPATH, as scripts/gpu_gate.sh
assembles it under /tmp/site), one version after the other (--order; a second call in the other
order shows whether a drifting card favoured the version that ran first). A run takes 4-5 minutes
on an H100. --draft MODEL (e.g. self:int8) adds a draft model's engine to the copy part (k = 4);
both versions then run the current checkout's benchmark scripts (the previous one's may not know
the option), each importing its own goodserve. --parts '' runs the copy part alone (about a minute
a version), for changes that touch speculation only.
CPU (--cpu): single-stream decode of the embedded model with its default gguf codes (128 tokens
after a 128-token prompt, as benchmarks/cpu_engine.py), versions alternating over --rounds
processes each, the median of each version's runs. Needs a quiet machine.

    git archive <previous commit> src benchmarks | tar -x -C .prev
    PYTHONPATH=/tmp/site python benchmarks/engine_core_compare.py --previous .prev [--order previous,current]
        [--draft self:int8] [--parts ''] | --cpu

Writes $OUT/engine_core_compare_<first>_first.json (GPU) or engine_core_compare_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from result_file import cpu_model_name, write_result

PARTS = "decode,int8,sharegpt"
METRICS = ("decode_bf16_tok_s", "decode_int8_tok_s", "sharegpt_offline_output_tok_s", "copy_ngram_batch_1_tok_s",
           "copy_ngram_batch_4_tok_s", "copy_draft_batch_1_tok_s", "copy_draft_batch_4_tok_s")


def metrics_of(results: dict) -> dict:
    """gpu_engine.json's numbers for METRICS: decode is the best of its runs, as gpu_engine.py reports it."""
    def best_decode(part: str) -> float | None:
        runs = results.get(part, {}).get("runs")
        return max(run["decode_tok_s"] for run in runs) if runs else None

    return {"decode_bf16_tok_s": best_decode("decode"), "decode_int8_tok_s": best_decode("decode_int8"),
            "sharegpt_offline_output_tok_s": results.get("throughput_sharegpt_like", {}).get("output_tok_s")}


def _path(*first: Path) -> str:
    """PYTHONPATH with a version's folders ahead of what it held (the wheels carried to the GPU)."""
    return ":".join([*map(str, first), *filter(None, [os.environ.get("PYTHONPATH")])])


def run_version(root: Path, out: Path, scripts: Path, draft: str | None, parts: str) -> dict:
    """One version's gpu_engine.py (its --parts, none when empty) in a process of its own, importing that
    version's goodserve, then its copy part; scripts: the benchmarks folder whose scripts run (the
    version's own, or the current one's)."""
    env = dict(os.environ, OUT=str(out), PYTHONPATH=_path(root / "src", scripts))
    start = time.perf_counter()
    results = {}
    if parts:
        subprocess.run([sys.executable, str(scripts / "gpu_engine.py"), "--parts", parts],
                       cwd=root, env=env, check=True)
        results = json.loads((out / "gpu_engine.json").read_text())
    copy = run_copy(root, env, scripts, draft)
    return {"seconds": time.perf_counter() - start, "card": results.get("card") or copy.get("card"),
            **metrics_of(results),
            **copy_metrics_of(copy), "errors": {k: v for k, v in results.items() if k.endswith("_error")}
            | copy.get("errors", {})}


def run_copy(root: Path, env: dict, scripts: Path, draft: str | None) -> dict:
    """One version's gpu_spec_decode.py copy part (it exits 1 when greedy outputs changed: recorded)."""
    done = subprocess.run([sys.executable, str(scripts / "gpu_spec_decode.py"), "--parts", "copy",
                           *(["--copy-draft", draft] if draft else [])], cwd=root, env=env)
    path = Path(env["OUT"]) / "gpu_spec_decode.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    return {**report, "exit_code": done.returncode}


def copy_metrics_of(report: dict) -> dict:
    """The copy part's ngram (and draft model's) output tok/s at batch 1 and 4, and whether its greedy
    outputs were identical."""
    copy = report.get("copy", {}).get("float32", {})
    rates = {f"copy_{method}_batch_{batch}_tok_s": copy.get(f"batch_{batch}", {}).get(f"{method}_k4", {}).get(
        "output_tok_s") for method in ("ngram", "draft") for batch in (1, 4)}
    # per batch and engine (speculation off too): the rate and the steps it took, which tell a slower
    # step from a worse speculation policy
    detail = {batch: {engine: {key: run.get(key) for key in COPY_DETAIL} for engine, run in runs.items()}
              for batch, runs in copy.items() if batch.startswith("batch_")}
    return {**rates, "copy_greedy_identical": report.get("copy_greedy_identical"),
            "copy_exit_code": report.get("exit_code"), "copy_detail": detail}


COPY_DETAIL = ("output_tok_s", "steps", "verifications", "accepted_tokens", "graphed_verify_steps", "pipelined_steps",
               "schedule_s", "prepare_s", "forward_s", "sample_s", "detokenize_s")
CPU_NEW_TOKENS = 128
CPU_RUNS = 5


def cpu_single_stream() -> dict:
    """In a version's own process: decode tok/s of CPU_RUNS single-stream runs."""
    from goodserve import LLM, SamplingParams

    llm = LLM()
    prompt = {"prompt_token_ids": np.random.default_rng(0).integers(100, 20000, 128).tolist()}
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4))
    params = SamplingParams(temperature=0, max_tokens=CPU_NEW_TOKENS, ignore_eos=True)
    rates, tokens = [], None
    for _ in range(CPU_RUNS):
        out = llm.generate(prompt, params)[0]
        times = out.metrics.token_times
        rates.append((CPU_NEW_TOKENS - 1) / (times[-1] - times[0]))
        tokens = out.outputs[0].token_ids
    return {"decode_tok_s_runs": rates, "token_ids": tokens, "quantization": llm.engine.config.quantization}


def compare_cpu(roots: dict[str, Path], rounds: int) -> dict:
    runs: dict[str, list[dict]] = {"previous": [], "current": []}
    for _ in range(rounds):
        for version in ("previous", "current"):
            env = dict(os.environ, PYTHONPATH=_path(roots[version] / "src", roots["current"] / "benchmarks"))
            done = subprocess.run([sys.executable, __file__, "--cpu-worker"], env=env, check=True,
                                  capture_output=True, text=True)
            runs[version].append(json.loads(done.stdout.strip().splitlines()[-1]))
    medians = {version: float(np.median([r for run in rs for r in run["decode_tok_s_runs"]]))
               for version, rs in runs.items()}
    return {"machine": f"{cpu_model_name()}, {os.cpu_count()} cores",
            "model": "smollm2-135m (embedded, default gguf codes), batch 1, 128-token prompt, 128 new tokens",
            "runs": runs, "median_decode_tok_s": medians,
            "same_tokens": runs["previous"][0]["token_ids"] == runs["current"][0]["token_ids"],
            "current_over_previous": medians["current"] / medians["previous"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--previous", help="a checkout of the previous commit")
    parser.add_argument("--order", default="previous,current")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--draft", help="a draft model's engine in the copy part too (e.g. self:int8)")
    parser.add_argument("--parts", default=PARTS,
                        help="gpu_engine.py's parts each version runs before the copy part ('' for the copy part only)")
    parser.add_argument("--cpu-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cpu_worker:
        print(json.dumps(cpu_single_stream()))
        return
    roots = {"previous": Path(args.previous).resolve(), "current": Path.cwd()}
    if args.cpu:
        result = compare_cpu(roots, args.rounds)
        print(json.dumps({k: result[k] for k in ("median_decode_tok_s", "same_tokens", "current_over_previous")}))
        write_result("engine_core_compare_cpu.json", result)
        return
    order = args.order.split(",")
    out_dir = Path(os.environ.get("OUT", "out"))
    scripts = {version: (roots["current"] if args.draft else root) / "benchmarks" for version, root in roots.items()}
    runs = {version: run_version(roots[version], out_dir / version, scripts[version], args.draft, args.parts)
            for version in order}
    result = {"card": runs["current"]["card"], "model": "dummy:llama-3.1-8b", "copy_model": "smollm2-135m, float32",
              "copy_draft": args.draft, "parts": args.parts, "order": order,
              "runs": runs, "current_over_previous": {
                  name: runs["current"][name] / runs["previous"][name]
                  if runs["previous"][name] and runs["current"][name] else None
                  for name in METRICS}}
    print(json.dumps(result["current_over_previous"], indent=1))
    write_result(f"engine_core_compare_{order[0]}_first.json", result)


if __name__ == "__main__":
    main()
