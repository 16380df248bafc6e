"""How long the embedded model takes to load, and how much of it is the GGUF header.

Each measurement in a fresh process (the header is cached per process), alternated, min over rounds:
- gguf's own reader (gguf.GGUFReader) on the embedded GGUF file;
- goodserve's reader of the same file (model/gguf_reader.py: arrays read in bulk);
- importing goodserve's LLM, and from that import to `LLM("smollm2-135m")`'s first token (the CPU
  default, as `goodserve serve` builds it).
With --baseline COMMIT the goodserve measurements also run on that commit's src/ (git archive), alternated.

    OMP_NUM_THREADS=2 PYTHONPATH=src python benchmarks/cpu_model_load.py --baseline 7f2f157   # $OUT/cpu_model_load.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from result_file import cpu_model_name, write_result

CHILD = {
    "gguf_reader_s": "import gguf; from goodserve.model.tokenizer_loader import embedded_gguf_path as p; "
                     "t = time.perf_counter(); gguf.GGUFReader(p()); s = time.perf_counter() - t",
    "goodserve_reader_s": "from goodserve.model.gguf_reader import open_gguf; "
                          "from goodserve.model.tokenizer_loader import embedded_gguf_path as p; "
                          "t = time.perf_counter(); open_gguf(p()); s = time.perf_counter() - t",
    "import_s": "t = time.perf_counter(); import goodserve.llm; s = time.perf_counter() - t",
    "import_to_first_token_s": "t = time.perf_counter(); from goodserve import LLM, SamplingParams; "
                               "LLM('smollm2-135m').generate('Hi', SamplingParams(max_tokens=1)); "
                               "s = time.perf_counter() - t",
}


REPO = Path(__file__).resolve().parent.parent


def measure(code: str, src: str) -> float:
    script = f"import time\n{code}\nprint(s)"
    env = {**os.environ, "PYTHONPATH": src}
    return float(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
                 .stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", help="a commit whose src/ also runs the goodserve measurements")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this tree": str(REPO / "src")}
        if args.baseline:
            archive = subprocess.run(["git", "-C", str(REPO), "archive", args.baseline, "src"], capture_output=True,
                                     check=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            trees[args.baseline] = os.path.join(tmp, "src")
        jobs = [(tree, name) for tree in trees for name in CHILD if tree == "this tree" or name != "gguf_reader_s"]
        runs = {f"{tree}: {name}": [] for tree, name in jobs}
        for _ in range(args.rounds):
            for tree, name in jobs:
                runs[f"{tree}: {name}"].append(measure(CHILD[name], trees[tree]))
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    result = {"cpu": cpu_model_name(), "commit": head.stdout.strip(), "rounds": args.rounds, "runs": runs,
              "best": {name: min(times) for name, times in runs.items()}}
    print(json.dumps(result["best"], indent=1))
    print(write_result("cpu_model_load.json", result))


if __name__ == "__main__":
    main()
