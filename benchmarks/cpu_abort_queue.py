"""Aborting queued requests: one request of 50 prompts x n=128 is 6,400 waiting
sequences; time aborting them all, newest first (as disconnects arrive), on the CPU.

The engine never steps, so every sequence stays in the waiting queue and only the queue's removal
cost is measured. Run it against any source tree to compare versions on one machine:

    PYTHONPATH=src python benchmarks/cpu_abort_queue.py            # writes $OUT/cpu_abort_queue.json
    PYTHONPATH=OLD/src python benchmarks/cpu_abort_queue.py --tag old
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from goodserve import SamplingParams
from goodserve.engine.frontend.engine import Engine
from result_file import write_result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--tag", default="current")
    args = parser.parse_args()
    # Without prefix caching all n samples of a request queue at once (with it, n - 1 wait beside it).
    engine = Engine(model="dummy:tiny", num_kv_blocks=64, enable_prefix_caching=False)
    params = SamplingParams(n=args.n, max_tokens=4)
    ids = [f"r{i}" for i in range(args.requests)]
    for request_id in ids:
        engine.add_request(request_id, [1, 2, 3], params)
    start = time.perf_counter()
    for request_id in reversed(ids):
        engine.abort_request(request_id)
    seconds = time.perf_counter() - start
    result = {"tag": args.tag, "machine": platform.processor() or platform.machine(),
              "sequences": args.requests * args.n, "abort_seconds": seconds}
    print(json.dumps(result))
    write_result(f"cpu_abort_queue_{args.tag}.json", result)


if __name__ == "__main__":
    main()
