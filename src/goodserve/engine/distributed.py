"""The tensor-parallel ranks' rendezvous and their plain-data channel, on torch.distributed.

Ranks join through env:// exactly as torchrun starts them (MASTER_ADDR, MASTER_PORT, WORLD_SIZE,
RANK, LOCAL_RANK), so ranks on other hosts join the same way. The tensors' collectives go through
the default group: NCCL for CUDA tensors (one GPU per rank: cuda:LOCAL_RANK), gloo for CPU ones.
Plain data (the engine config once, then each call of the executor: the scheduler's output and the
grammar masks) goes from rank 0 to the others through a gloo group of its own, rank 0 being the one
the engine talks to.

A collective waits GOODSERVE_DISTRIBUTED_TIMEOUT_S (default 300) seconds for a peer before it
fails (and the engine reports the ranks lost); the message group waits without limit, since a
server may sit idle for days (a rank whose peer exits sees the connection close at once).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket

import torch
import torch.distributed as dist

from goodserve.config import EngineConfig
from goodserve.model.tensor_parallel import TensorParallel

ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")
_IDLE_FOREVER = datetime.timedelta(days=365)


@dataclasses.dataclass(frozen=True)
class Rank:
    tp: TensorParallel
    local_rank: int
    messages: dist.ProcessGroup  # gloo: rank 0 -> all, plain data


def launch_env(world_size: int, rank: int, local_rank: int) -> dict[str, str]:
    """What torchrun would set for a rank of this host; MASTER_ADDR / MASTER_PORT from the engine's
    own environment when set (the other hosts must reach them), else this host and a free port."""
    return {"MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": os.environ.get("MASTER_PORT") or str(_free_port()),
            "WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": str(local_rank)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def join() -> Rank:
    """Join the process group the environment names (blocks until every rank has joined)."""
    missing = [name for name in ENV_NAMES if name not in os.environ]
    if missing:
        raise RuntimeError(f"a tensor-parallel rank needs {', '.join(missing)} in its environment (as torchrun sets)")
    local_rank = int(os.environ["LOCAL_RANK"])
    timeout = datetime.timedelta(seconds=float(os.environ.get("GOODSERVE_DISTRIBUTED_TIMEOUT_S", 300)))
    backend = "gloo"
    # Lets CUDA graphs capture torch's NCCL collectives (vLLM's finding, vllm-project/vllm#2152):
    # read when the process group is made.
    os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, init_method="env://", timeout=timeout)
    messages = dist.new_group(backend="gloo", timeout=_IDLE_FOREVER)
    return Rank(TensorParallel(dist.get_rank(), dist.get_world_size()), local_rank, messages)


def for_rank(config: EngineConfig, rank: Rank) -> EngineConfig:
    """The config as this rank runs it: its own GPU."""
    if torch.device(config.device).type == "cuda":
        return dataclasses.replace(config, device=f"cuda:{rank.local_rank}")
    return config


def broadcast(message, rank: Rank):
    """Rank 0's message, on every rank (rank 0 passes it, the others get it)."""
    box = [message]
    dist.broadcast_object_list(box, src=0, group=rank.messages)
    return box[0]


def min_over_ranks(value: int, rank: Rank) -> int:
    """What every rank can afford (KV blocks: the block tables are the same on all ranks)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=rank.messages)
    return int(t.item())
