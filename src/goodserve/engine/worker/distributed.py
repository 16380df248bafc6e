"""The ranks' rendezvous, their layout (tensor-parallel groups within pipeline stages) and their
plain-data channel, on torch.distributed.

Ranks join through env:// exactly as torchrun starts them (MASTER_ADDR, MASTER_PORT, WORLD_SIZE,
RANK, LOCAL_RANK), so ranks on other hosts join the same way. The tensors' collectives go through
the default group: NCCL for CUDA tensors (one GPU per rank: cuda:LOCAL_RANK), gloo for CPU ones.
Plain data (the engine config once, then each step of the executor: the scheduler's output and the
grammar masks) goes from rank 0 to the others, rank 0 being the one the engine talks to: the steps
through a shared-memory ring (engine/worker/shm_broadcast.py) when every rank runs on rank 0's host
(LOCAL_WORLD_SIZE = WORLD_SIZE), else, and the config always, through a gloo group of its own. Under pipeline parallelism the last stage samples: its first rank sends
each step's output (plain data) to rank 0 on the same group.

Layout: ranks are stage-major (model/pipeline_parallel.py): stage s holds ranks s*N .. s*N+N-1,
which form its tensor-parallel group; without pipeline stages that group is the default one.

A collective waits GOODSERVE_DISTRIBUTED_TIMEOUT_S (default 300) seconds for a peer before it
fails (and the engine reports the ranks lost); the message group waits without limit, since a
server may sit idle for days (a rank whose peer exits sees the connection close at once).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
from collections.abc import Callable

import torch
import torch.distributed as dist

from goodserve.config import EngineConfig
from goodserve.engine.worker.context_parallel import ContextParallel
from goodserve.engine.worker.shm_broadcast import Reader, Writer
from goodserve.errors import InvalidRequestError
from goodserve.model.pipeline_parallel import PipelineParallel
from goodserve.model.tensor_parallel import TensorParallel
from goodserve.ports import free_port

ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")
_IDLE_FOREVER = datetime.timedelta(days=365)


@dataclasses.dataclass(frozen=True)
class Rank:
    tp: TensorParallel
    local_rank: int
    messages: dist.ProcessGroup  # gloo: rank 0 -> all, plain data
    pp: PipelineParallel = PipelineParallel()
    cp: ContextParallel = ContextParallel()
    steps: Writer | Reader | None = None  # rank 0's end or another's of the steps' ring; None: gloo
    # The last stage's answers on their way to rank 0, kept until sent (rank 0 takes each only once
    # it has launched the micro-batches after it)
    answers_sent: list = dataclasses.field(default_factory=list, compare=False)


def launch_env(world_size: int, rank: int, local_rank: int) -> dict[str, str]:
    """What torchrun would set for a rank of this host; MASTER_ADDR / MASTER_PORT from the engine's
    own environment when set (the other hosts must reach them), else this host and a free port."""
    return {"MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": os.environ.get("MASTER_PORT") or str(free_port("")),
            "WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": str(local_rank)}


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


def arrange(rank: Rank, config: EngineConfig) -> Rank:
    """This rank's place in the config's layout (every rank calls it: each makes every stage's group).
    Context parallelism (alone, for now) gives every rank the whole model."""
    n, m, c = config.tensor_parallel_size, config.pipeline_parallel_size, config.context_parallel_size
    world, me = dist.get_world_size(), dist.get_rank()
    if world != n * m * c:
        raise InvalidRequestError(f"{world} ranks joined, but tensor-parallel size {n} x pipeline-parallel "
                                  f"size {m} x context-parallel size {c} needs {n * m * c}")
    if c > 1:
        return dataclasses.replace(rank, tp=TensorParallel(), cp=ContextParallel(me, c))
    if m == 1:
        return rank
    groups = [dist.new_group(list(range(stage * n, (stage + 1) * n))) for stage in range(m)]
    stage = me // n
    return dataclasses.replace(rank, tp=TensorParallel(me % n, n, groups[stage]), pp=PipelineParallel(stage, m, n))


def open_step_ring(rank: Rank) -> Rank:
    """The steps' ring, where every rank runs on this host (every rank calls it). A rank's death
    leaves no name behind: rank 0 removes it once all have attached."""
    world = dist.get_world_size()
    local = dist.get_rank() == 0 and int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world
    ring = Writer(num_readers=world - 1) if local else None
    handle = broadcast(ring and ring.handle(), rank)
    if handle is None:
        return rank
    if ring is None:
        ring = Reader(handle, dist.get_rank() - 1, alive=_parent_alive())
    dist.barrier(group=rank.messages)
    if isinstance(ring, Writer):
        ring.unlink()
    return dataclasses.replace(rank, steps=ring)


def from_last_stage(answer, rank: Rank):
    """The last stage's answer to a step (where the logits are), on rank 0; others keep their own.
    The last stage sends it without waiting for rank 0 to take it: rank 0, with micro-batches in
    flight, first launches the next step, whose hidden states wait for the last stage to take them."""
    last = (rank.pp.size - 1) * rank.pp.tp_size
    if rank.pp.size == 1 or dist.get_rank() not in (0, last):
        return answer
    if dist.get_rank() == last:
        payload = torch.frombuffer(bytearray(pickle.dumps(answer)), dtype=torch.uint8)
        length = torch.tensor([len(payload)], dtype=torch.int64)
        rank.answers_sent[:] = [sent for sent in rank.answers_sent if not sent[0].is_completed()]
        rank.answers_sent.extend((dist.isend(t, dst=0, group=rank.messages), t) for t in (length, payload))
        return answer
    length = torch.empty(1, dtype=torch.int64)
    dist.recv(length, src=last, group=rank.messages)
    payload = torch.empty(int(length), dtype=torch.uint8)
    dist.recv(payload, src=last, group=rank.messages)
    return pickle.loads(payload.numpy().tobytes())


def for_rank(config: EngineConfig, rank: Rank) -> EngineConfig:
    """The config as this rank runs it: its own GPU."""
    if torch.device(config.device).type == "cuda":
        return dataclasses.replace(config, device=f"cuda:{rank.local_rank}")
    return config


def broadcast(message, rank: Rank):
    """Rank 0's message, on every rank (rank 0 passes it, the others get it)."""
    if isinstance(rank.steps, Writer):
        rank.steps.enqueue(message)
        return message
    if isinstance(rank.steps, Reader):
        return rank.steps.dequeue()
    box = [message]
    dist.broadcast_object_list(box, src=0, group=rank.messages)
    return box[0]


def _parent_alive() -> Callable[[], bool]:
    """Whether the engine that spawned this rank still runs (rank 0's death the engine sees, and
    ends every rank; the engine's own death hands them to a new parent)."""
    parent = os.getppid()
    return lambda: os.getppid() == parent


def min_over_ranks(value: int, rank: Rank) -> int:
    """What every rank can afford (KV blocks: the block tables are the same on all ranks)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=rank.messages)
    return int(t.item())
