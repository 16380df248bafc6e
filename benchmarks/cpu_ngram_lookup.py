"""Prompt lookup's host cost a step: one proposal (ngram 1..4, k = 4) for a sequence that grows a
token a step, at several context lengths (random ids over 2,000 values, so matches are rare and the
whole context is scanned). `propose_ngram` (the id list converted whole at each call) in each
version given, and, where the version has it, NgramProposer's per-sequence array extended a step at
a time; each version imported in a process of its own, microseconds per proposal, best of --repeats.

    python benchmarks/cpu_ngram_lookup.py --versions before=/path/to/old/src,after=src

Writes $OUT/cpu_ngram_lookup.json (benchmarks/result_file.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from result_file import cpu_model_name, write_result  # noqa: E402

CONTEXTS = (500, 8000, 32000)
STEPS = 200


def time_steps(propose, context: int, repeats: int) -> float:
    """Microseconds a proposal, best of repeats: STEPS proposals as the sequence grows a token each."""
    rng = random.Random(context)
    base = [rng.randrange(2000) for _ in range(context + STEPS)]
    best = float("inf")
    for _ in range(repeats):
        ids = base[:context]
        propose(ids)  # a proposer's first call takes the whole context in
        start = time.perf_counter()
        for token in base[context:]:
            ids.append(token)
            propose(ids)
        best = min(best, (time.perf_counter() - start) / STEPS * 1e6)
    return round(best, 1)


def measure(repeats: int) -> dict:
    """In this process, on whatever goodserve PYTHONPATH gives."""
    from goodserve.engine.spec_decode import ngram

    found = {"propose_ngram_us": {n: time_steps(lambda ids: ngram.propose_ngram(ids, 1, 4, 4), n, repeats)
                                  for n in CONTEXTS}}
    if hasattr(ngram, "NgramProposer") and hasattr(ngram.NgramProposer(1, 4), "arrays"):
        from goodserve.engine.seam.drafts import DraftRequest

        def proposer_timing(context: int) -> float:
            proposer = ngram.NgramProposer(1, 4)
            return time_steps(lambda ids: proposer.propose([DraftRequest("s", ids, 4)]), context, repeats)

        found["proposer_us"] = {n: proposer_timing(n) for n in CONTEXTS}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", default="current=src", help="name=path/to/src,...")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.repeats)))
        return
    results = {}
    for item in args.versions.split(","):
        name, path = item.split("=", 1)
        env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
        done = subprocess.run([sys.executable, __file__, "--child", "--repeats", str(args.repeats)], env=env,
                              capture_output=True, text=True, check=True)
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(name, results[name], flush=True)
    path = write_result("cpu_ngram_lookup.json", {"cpu": cpu_model_name(), "steps": STEPS, "versions": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
