"""The engine's handle on its workers. `uni`: one worker in the engine's own process (calls are plain
method calls). `mp`: the worker in a process of its own, reached through a pipe: everything that
crosses is plain data (the scheduler's output, the grammar masks, the runner's output). Tensor
parallelism runs N such workers, one per rank, pipeline parallelism M stages of them (N x M ranks);
the engine's scheduler runs once and every rank gets its same plain-data output. Under pipeline
parallelism the engine keeps a step in flight for each stage (micro-batches of different sequences):
rank 0 launches a step's first stage and answers at once, and takes the last stage's output of the
oldest step (which is the step's) once the stages are full.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
from collections import deque
from multiprocessing.connection import Connection

import torch.distributed as dist

from goodserve.config import EngineConfig
from goodserve.engine.worker import distributed
from goodserve.engine.processes.gc_pauses import freeze_startup_heap
from goodserve.engine.seam.runner_output import PendingOutput
from goodserve.engine.worker.sampling_inputs import GrammarBitmask
from goodserve.engine.seam.scheduler_output import SchedulerOutput
from goodserve.engine.processes.stop_signals import kill_at_exit, leave_stopping_to_the_parent
from goodserve.engine.worker.worker import ModelInfo, Worker
from goodserve.errors import EngineDeadError, GoodserveError

logger = logging.getLogger("goodserve.engine")


class UniProcExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        self.info: ModelInfo = self.worker.info

    def execute_model(self, out: SchedulerOutput) -> None:
        self.worker.execute_model(out)

    def sample_tokens(self, grammar: GrammarBitmask | None, trial: bool = False,
                      may_run_ahead: bool = False) -> PendingOutput:
        """may_run_ahead: whether the engine may launch the next step before it reads this one's
        output (in one process the output simply waits on the device until it does)."""
        return self.worker.sample_tokens(grammar, trial)

    def shutdown(self) -> None:
        pass


class MultiprocExecutor:
    """The workers in spawned processes: one (`mp`), or the tensor-parallel ranks this host runs
    (all of them unless LOCAL_WORLD_SIZE says fewer: the rest join from other hosts through
    `goodserve worker`). The engine sends rank 0 one message a step through a pipe; rank 0 hands it
    on to the other ranks (engine/worker/distributed.py: a shared-memory ring on one host) and answers.

    Async scheduling: a step the engine may run ahead of (it says so with the step) and that
    replayed a graph is answered at once with "held" and its output comes with the reply to the
    engine's next message, the next step (launched first, so the device runs it while the host
    reads the tokens) or, where the engine needs the output before any next step, a request for it.
    Under pipeline parallelism every step the engine runs ahead of is held, up to one a stage after
    the first. Other steps are answered with their output, after those held before them."""

    def __init__(self, config: EngineConfig) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        world = config.world_size
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if world > 1 else 1
        env = distributed.launch_env(world, 0, 0) if world > 1 else None
        self._processes = []
        for rank in range(local):
            rank_env = env and env | {"RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(local)}
            if rank == 0:
                target, args = _leader_main, (child, config, rank_env)
            else:
                target, args = _local_follower_main, (rank_env,)
            process = context.Process(target=target, args=args, daemon=True, name=f"goodserve-worker-{rank}")
            process.start()
            kill_at_exit(process)
            self._processes.append(process)
        child.close()
        try:
            self.info: ModelInfo = self._value(self._receive()[1])
        except BaseException:  # a rank that failed to start: the others may wait for it, and ignore SIGTERM
            self.shutdown()
            raise
        self._held: deque[_Held] = deque()  # the steps whose outputs rank 0 holds, oldest first
        self._held_graphed = config.pipeline_parallel_size == 1  # stages replay no graphs

    def execute_model(self, out: SchedulerOutput) -> None:
        self._launching = out  # sent with the step's grammar masks: one message a step

    def sample_tokens(self, grammar: GrammarBitmask | None, trial: bool = False,
                      may_run_ahead: bool = False) -> PendingOutput:
        out, self._launching = self._launching, None
        output = self._value(self._ask((out, grammar, trial, may_run_ahead)))
        if output is not None:
            return PendingOutput(lambda: output, replayed_graph=False)
        held = _Held()
        self._held.append(held)
        return PendingOutput(lambda: self._held_output(held), replayed_graph=self._held_graphed)

    def shutdown(self) -> None:
        if self._processes[0].is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(None)
            self._processes[0].join(10)
        for process in self._processes:  # a rank stuck waiting for a lost peer
            process.join(1)
            if process.is_alive():
                process.kill()
            atexit.unregister(process.kill)
        self._conn.close()

    def _held_output(self, held: _Held):
        while held.answer is None:  # still held: rank 0 sends the oldest one it holds when asked
            self._ask(_SEND_HELD)
        return self._value(held.answer)

    def _ask(self, message) -> tuple[bool, object] | None:
        """Send rank 0 a message; its reply brings the answers of held steps it settled (oldest
        first), then the answer to this message (None for _SEND_HELD)."""
        try:
            self._conn.send(message)
        except OSError:  # rank 0's process is gone
            raise self._lost() from None
        earlier, answer = self._receive()
        for settled in earlier:
            self._held.popleft().answer = settled
        return answer

    def _receive(self):
        """Rank 0's reply; a worker process that died instead ends the engine, with its exit code
        (unless rank 0's own word comes soon: a load error, which every rank hits, says more)."""
        while not self._conn.poll(_LIVENESS_POLL_S):
            if self._exited() and not self._conn.poll(_LAST_WORD_S):
                raise self._exited()
        try:
            return self._conn.recv()
        except EOFError:
            raise self._lost() from None

    def _value(self, answer: tuple[bool, object]):
        """An answer's value, or its error raised. Rank 0's account of a user's error stands; any
        other may come from a lost rank."""
        ok, value = answer
        if ok:
            return value
        exited = self._exited()
        if exited is None or (isinstance(value, GoodserveError) and not isinstance(value, EngineDeadError)):
            raise value
        raise exited from value

    def _lost(self) -> EngineDeadError:
        return self._exited() or EngineDeadError("the worker process closed its pipe")

    def _exited(self) -> EngineDeadError | None:
        for rank, process in enumerate(self._processes):
            if process.exitcode is not None:
                return EngineDeadError(f"worker process of rank {rank} (pid {process.pid}) exited with code "
                                       f"{process.exitcode}; the engine cannot go on (its log says why)")
        return None


class _Held:
    """A step's output that rank 0 holds: its answer, once it came."""

    answer: tuple[bool, object] | None = None


# The engine's request for the output rank 0 holds, when it launches no step before it needs it.
_SEND_HELD = "send held"

# How often the engine, waiting for a step, checks that every worker process still lives, and how
# long it then waits for rank 0's own account.
_LIVENESS_POLL_S = 0.5
_LAST_WORD_S = 2.0


def _leader_main(conn: Connection, config: EngineConfig, env: dict[str, str] | None) -> None:
    """Rank 0 (or the only worker): build the worker, then answer the engine's messages until told
    to stop (None), handing each step to the other ranks first."""
    leave_stopping_to_the_parent()
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
        conn.send(((), (False, exc)))
        return
    freeze_startup_heap()
    conn.send(((), (True, worker.info)))
    held: deque[PendingOutput] = deque()  # launched steps whose outputs wait for later messages
    while True:
        message = conn.recv()
        if rank is not None and message != _SEND_HELD:
            try:
                distributed.broadcast(message, rank)
            except Exception as exc:  # noqa: BLE001 - a lost rank: nothing more can run
                conn.send(((), (False, EngineDeadError(f"tensor-parallel ranks lost: {exc}"))))
                return
        if message is None:
            return
        try:
            if message == _SEND_HELD:
                reply = ([_settle_held(held.popleft(), rank)], None)
            else:
                reply = _step(worker, rank, message, held)
        except Exception as exc:  # noqa: BLE001 - a collective failed (a request's error is an answer)
            conn.send(((), (False, EngineDeadError(f"tensor-parallel collective failed: {exc}"))))
            return
        conn.send(reply)


def _step(worker: Worker, rank: distributed.Rank | None, message: tuple, held: deque[PendingOutput]):
    """Launch a step, then settle the held steps beyond the depth kept in flight (their tokens the
    device computed while the host prepared this one, as in the engine's own process). Returns the
    answers of the held steps settled, oldest first, and this step's ((True, None): held). A step is
    held where the engine may run ahead of it and it replayed a graph, or, under pipeline
    parallelism, on rank 0 (the last stage sends each answer as soon as it has it)."""
    out, grammar, trial, may_run_ahead = message
    try:
        worker.execute_model(out)
        pending, answer = worker.sample_tokens(grammar, trial), None
    except dist.DistError:
        raise
    except Exception as exc:  # noqa: BLE001 - a request's error: the engine isolates it
        pending, answer = None, (False, exc)
    if pending is not None and may_run_ahead and _holds(pending, rank):
        held.append(pending)
        return [_settle_held(held.popleft(), rank) for _ in range(len(held) - _held_depth(rank))], (True, None)
    earlier = [_settle_held(held.popleft(), rank) for _ in range(len(held))]
    return earlier, _from_last_stage(answer or _settle(pending), rank)


def _holds(pending: PendingOutput, rank: distributed.Rank | None) -> bool:
    if rank is not None and rank.pp.size > 1:
        return dist.get_rank() == 0
    return pending.replayed_graph


def _held_depth(rank: distributed.Rank | None) -> int:
    """Steps rank 0 leaves held once it has launched one: one a stage after the first (micro-batches
    in flight), or the one launched (async scheduling)."""
    return max(rank.pp.size - 1, 1) if rank is not None else 1


def _settle_held(pending: PendingOutput, rank: distributed.Rank | None) -> tuple[bool, object]:
    return _from_last_stage(_settle(pending), rank)


def _from_last_stage(answer: tuple[bool, object], rank: distributed.Rank | None) -> tuple[bool, object]:
    return distributed.from_last_stage(answer, rank) if rank is not None else answer


def _settle(pending: PendingOutput) -> tuple[bool, object]:
    """A launched step's answer: (True, its output), or (False, a request's error)."""
    try:
        return True, pending.result()
    except dist.DistError:
        raise
    except Exception as exc:  # noqa: BLE001 - a request's error: the engine isolates it
        return False, exc


def _local_follower_main(env: dict[str, str]) -> None:
    leave_stopping_to_the_parent()
    run_follower(env)


def run_follower(env: dict[str, str] | None = None) -> None:
    """A rank other than 0, on this host (env: its variables) or another (`goodserve worker`, from
    torchrun's): gets the config from rank 0, builds its share, then runs what rank 0 hands on,
    holding the steps rank 0 holds (it waits for their tokens once the next step has launched)."""
    if env is not None:
        os.environ.update(env)
    rank = distributed.join()
    config = distributed.broadcast(None, rank)
    rank = distributed.open_step_ring(distributed.arrange(rank, config))
    worker = Worker(distributed.for_rank(config, rank), rank)
    freeze_startup_heap()
    held: deque[PendingOutput] = deque()
    while (message := distributed.broadcast(None, rank)) is not None:
        earlier, answer = _step(worker, rank, message, held)
        for answer in (*earlier, answer):
            if not answer[0]:  # a request's error, which rank 0 reports
                logger.debug("rank %d: step failed", dist.get_rank(), exc_info=answer[1])


def make_executor(config: EngineConfig) -> UniProcExecutor | MultiprocExecutor:
    if config.executor_backend == "mp" or config.world_size > 1:
        return MultiprocExecutor(config)
    return UniProcExecutor(config)
