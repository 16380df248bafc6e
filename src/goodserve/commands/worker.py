"""`goodserve worker`: one tensor- or pipeline-parallel rank on a host other than the engine's.

The engine's host runs `goodserve serve --tensor-parallel-size N [--pipeline-parallel-size M]` with
MASTER_ADDR / MASTER_PORT set (and LOCAL_WORLD_SIZE, the ranks it starts itself: 0 ..
LOCAL_WORLD_SIZE-1); every other rank runs this command with the variables torchrun sets (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), e.g. `torchrun --nnodes 2 --node-rank 1
--nproc-per-node 4 --master-addr HOST --master-port PORT -m goodserve worker`. It takes the
engine's config from rank 0 (and from it its layout: its stage and tensor-parallel group), so it
needs no model flags, only the same model files at the same path.
"""

from __future__ import annotations

import argparse
import os


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "worker",
        help="run one tensor- or pipeline-parallel rank for an engine on another host (torchrun's environment)",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from goodserve.engine.worker.executor import run_follower
    from goodserve.errors import InvalidRequestError

    if os.environ.get("RANK") == "0":
        raise InvalidRequestError("rank 0 is the engine's own (`goodserve serve --tensor-parallel-size N`); "
                                  "`goodserve worker` runs the ranks after it")
    run_follower()
    return 0
