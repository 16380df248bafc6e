"""The engine's handle on its workers. `uni`: one worker in the engine's own process (calls are plain
method calls). `mp`: the worker in a process of its own, reached through a pipe: everything that
crosses is plain data (the scheduler's output, the grammar masks, the runner's output). Tensor
parallelism runs N such workers, one per rank, pipeline parallelism M stages of them (N x M ranks);
the engine's scheduler runs once and every rank gets its same plain-data output. Steps go through
the stages one at a time (no micro-batches in flight yet): the last stage's output is the step's.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
from multiprocessing.connection import Connection

import torch.distributed as dist

from goodserve.config import EngineConfig
from goodserve.engine import distributed
from goodserve.engine.runner_output import PendingOutput
from goodserve.engine.sampling_inputs import GrammarBitmask
from goodserve.engine.scheduler_output import SchedulerOutput
from goodserve.engine.worker import ModelInfo, Worker
from goodserve.errors import EngineDeadError, GoodserveError

logger = logging.getLogger("goodserve.engine")


class UniProcExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        self.info: ModelInfo = self.worker.info

    def execute_model(self, out: SchedulerOutput) -> None:
        self.worker.execute_model(out)

    def sample_tokens(self, grammar: GrammarBitmask | None, trial: bool = False) -> PendingOutput:
        return self.worker.sample_tokens(grammar, trial)

    def shutdown(self) -> None:
        pass


class MultiprocExecutor:
    """The workers in spawned processes: one (`mp`), or the tensor-parallel ranks this host runs
    (all of them unless LOCAL_WORLD_SIZE says fewer: the rest join from other hosts through
    `goodserve worker`). The engine sends rank 0 one message a step through a pipe; rank 0 hands it
    on to the other ranks (engine/distributed.py: a shared-memory ring on one host) and answers
    with its own result. Steps run synchronously (the engine reads each step's output before the
    next is launched)."""

    def __init__(self, config: EngineConfig) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        world = config.world_size
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if world > 1 else 1
        env = distributed.launch_env(world, 0, 0) if world > 1 else None
        self._processes = []
        for rank in range(local):
            rank_env = env and env | {"RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(local)}
            target, args = (_leader_main, (child, config, rank_env)) if rank == 0 else (run_follower, (rank_env,))
            process = context.Process(target=target, args=args, daemon=True, name=f"goodserve-worker-{rank}")
            process.start()
            self._processes.append(process)
        child.close()
        self.info: ModelInfo = self._receive()

    def execute_model(self, out: SchedulerOutput) -> None:
        self._launching = out  # sent with the step's grammar masks: one message a step

    def sample_tokens(self, grammar: GrammarBitmask | None, trial: bool = False) -> PendingOutput:
        out, self._launching = self._launching, None
        self._conn.send((out, grammar, trial))
        output = self._receive()
        return PendingOutput(lambda: output, replayed_graph=False)

    def shutdown(self) -> None:
        if self._processes[0].is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(None)
            self._processes[0].join(10)
        for process in self._processes:  # a rank stuck waiting for a lost peer
            process.join(1)
            if process.is_alive():
                process.terminate()
        self._conn.close()

    def _receive(self):
        """Rank 0's answer; a worker process that died instead ends the engine, with its exit code
        (unless rank 0's own word comes soon: a load error, which every rank hits, says more)."""
        while not self._conn.poll(_LIVENESS_POLL_S):
            if self._exited() and not self._conn.poll(_LAST_WORD_S):
                raise self._exited()
        try:
            ok, value = self._conn.recv()
        except EOFError:
            raise self._exited() or EngineDeadError("the worker process closed its pipe") from None
        if not ok:  # rank 0's account of a user's error stands; any other may come from a lost rank
            exited = self._exited()
            if exited is None or (isinstance(value, GoodserveError) and not isinstance(value, EngineDeadError)):
                raise value
            raise exited from value
        return value

    def _exited(self) -> EngineDeadError | None:
        for rank, process in enumerate(self._processes):
            if process.exitcode is not None:
                return EngineDeadError(f"worker process of rank {rank} (pid {process.pid}) exited with code "
                                       f"{process.exitcode}; the engine cannot go on (its log says why)")
        return None


# How often the engine, waiting for a step, checks that every worker process still lives, and how
# long it then waits for rank 0's own account.
_LIVENESS_POLL_S = 0.5
_LAST_WORD_S = 2.0


def _leader_main(conn: Connection, config: EngineConfig, env: dict[str, str] | None) -> None:
    """Rank 0 (or the only worker): build the worker, then answer the engine's steps until told to
    stop (None), handing each to the other ranks first."""
    try:
        rank = None
        if env is not None:
            os.environ.update(env)
            rank = distributed.join()
            distributed.broadcast(config, rank)
            rank = distributed.open_step_ring(distributed.arrange(rank, config))
            config = distributed.for_rank(config, rank)
        worker = Worker(config, rank)
    except BaseException as exc:  # noqa: BLE001 - reported to the engine, which raises it
        conn.send((False, exc))
        return
    conn.send((True, worker.info))
    while True:
        message = conn.recv()
        if rank is not None:
            try:
                distributed.broadcast(message, rank)
            except Exception as exc:  # noqa: BLE001 - a lost rank: nothing more can run
                conn.send((False, EngineDeadError(f"tensor-parallel ranks lost: {exc}")))
                return
        if message is None:
            return
        try:
            answer = (True, _step(worker, *message))
        except dist.DistError as exc:
            conn.send((False, EngineDeadError(f"tensor-parallel collective failed: {exc}")))
            return
        except Exception as exc:  # noqa: BLE001 - a request's error: the engine isolates it
            answer = (False, exc)
        if rank is not None:
            try:
                answer = distributed.from_last_stage(answer, rank)
            except Exception as exc:  # noqa: BLE001 - a lost rank: nothing more can run
                conn.send((False, EngineDeadError(f"tensor-parallel ranks lost: {exc}")))
                return
        conn.send(answer)


def _step(worker: Worker, out: SchedulerOutput, grammar: GrammarBitmask | None, trial: bool):
    worker.execute_model(out)
    return worker.sample_tokens(grammar, trial).result()


def run_follower(env: dict[str, str] | None = None) -> None:
    """A rank other than 0, on this host (env: its variables) or another (`goodserve worker`, from
    torchrun's): gets the config from rank 0, builds its share, then runs what rank 0 hands on."""
    if env is not None:
        os.environ.update(env)
    rank = distributed.join()
    config = distributed.broadcast(None, rank)
    rank = distributed.open_step_ring(distributed.arrange(rank, config))
    worker = Worker(distributed.for_rank(config, rank), rank)
    while (message := distributed.broadcast(None, rank)) is not None:
        try:
            answer = (True, _step(worker, *message))
        except dist.DistError:
            raise
        except Exception as exc:  # noqa: BLE001 - a request's error, which rank 0 reports
            logger.debug("rank %d: step failed", dist.get_rank(), exc_info=True)
            answer = (False, exc)
        distributed.from_last_stage(answer, rank)


def make_executor(config: EngineConfig) -> UniProcExecutor | MultiprocExecutor:
    if config.executor_backend == "mp" or config.world_size > 1:
        return MultiprocExecutor(config)
    return UniProcExecutor(config)
