"""The engine's handle on its workers. `uni`: one worker in the engine's own process (calls are plain
method calls). `mp`: the worker in a process of its own, reached through a pipe: everything that
crosses is plain data (the scheduler's output, the grammar masks, the runner's output), which is
what running N workers, one per GPU, needs (the parallelism issue builds on this seam).
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection

from goodserve.config import EngineConfig
from goodserve.engine.runner_output import PendingOutput
from goodserve.engine.sampling_inputs import GrammarBitmask
from goodserve.engine.scheduler_output import SchedulerOutput
from goodserve.engine.worker import ModelInfo, Worker


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
    """One worker in a spawned process. Its steps run synchronously (the engine reads each step's
    output before the next is launched): pipelining across the pipe is the parallelism issue's."""

    def __init__(self, config: EngineConfig) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_worker_main, args=(child, config), daemon=True,
                                        name="goodserve-worker")
        self._process.start()
        child.close()
        self.info: ModelInfo = self._receive()

    def execute_model(self, out: SchedulerOutput) -> None:
        self._call("execute_model", out)

    def sample_tokens(self, grammar: GrammarBitmask | None, trial: bool = False) -> PendingOutput:
        output = self._call("sample_tokens", grammar, trial)
        return PendingOutput(lambda: output, replayed_graph=False)

    def shutdown(self) -> None:
        if self._process.is_alive():
            self._conn.send(None)
            self._process.join(10)
        self._conn.close()

    def _call(self, method: str, *args):
        self._conn.send((method, args))
        return self._receive()

    def _receive(self):
        ok, value = self._conn.recv()
        if not ok:
            raise value
        return value


def _worker_main(conn: Connection, config: EngineConfig) -> None:
    """The worker process: build the worker, then answer calls until told to stop (None)."""
    try:
        worker = Worker(config)
    except BaseException as exc:  # noqa: BLE001 - reported to the engine, which raises it
        conn.send((False, exc))
        return
    conn.send((True, worker.info))
    while (message := conn.recv()) is not None:
        method, args = message
        try:
            result = getattr(worker, method)(*args)
            conn.send((True, result.result() if method == "sample_tokens" else result))
        except Exception as exc:  # noqa: BLE001 - a request's error: the engine isolates it
            conn.send((False, exc))


def make_executor(config: EngineConfig) -> UniProcExecutor | MultiprocExecutor:
    return MultiprocExecutor(config) if config.executor_backend == "mp" else UniProcExecutor(config)
