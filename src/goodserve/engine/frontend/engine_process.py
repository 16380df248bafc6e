"""The engine in a process of its own (`goodserve serve --engine-process`), as vLLM's V1 engine core
runs: the serving process keeps the HTTP event loop and each request's stream; the engine process
schedules, runs the model (or drives its workers), samples and detokenizes. Each process has its own
GIL, so the event loop's work a token never delays a step. On an H200 at 256 streams the server
reached half the output rate of the same engine driven in-process, and moving only the runner out
(`--executor-backend mp`) did not recover it (benchmarks/BENCHMARKS.md).

One pipe carries commands in (add, abort, stop) and one message a step out: the step's outputs, the
engine's stats, its SLO forecast and its process's garbage-collector pauses. A running request's outputs cross without the prompt's token
ids and the token times, which repeat or grow with every step; its finished output carries both,
and that is the one the server reads them from.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import queue
import threading
from dataclasses import replace
from multiprocessing.connection import Connection

from goodserve.config import EngineConfig
from goodserve.engine.frontend.async_engine import _IDLE_WAIT_S, EngineClient, EngineInfo, Failed, _Abort, _Add, apply_command
from goodserve.engine.processes.gc_pauses import PauseLog, freeze_startup_heap, tune_for_serving, watch_pauses
from goodserve.engine.processes.stop_signals import leave_stopping_to_the_parent
from goodserve.errors import EngineDeadError, EngineStepError, GoodserveError
from goodserve.outputs import RequestMetrics, RequestOutput

logger = logging.getLogger("goodserve.engine")

_STOP_TIMEOUT_S = 10.0
_STOP = "stop"


class EngineProcess(EngineClient):
    runs_in_own_process = True

    def __init__(self, config: EngineConfig) -> None:
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._conn, child = context.Pipe()
        # Not a daemon: it may start worker processes of its own (--executor-backend mp, tensor parallelism).
        self.process = context.Process(target=run_engine_process, args=(child, config, logging.getLogger().level),
                                       name="goodserve-engine-core")
        self.process.start()
        child.close()
        try:
            first = self._conn.recv()
        except EOFError:
            self.process.join(5.0)
            raise EngineDeadError(f"the engine process exited with {self.process.exitcode} while starting "
                                  f"(its log is above)") from None
        if isinstance(first, BaseException):
            self.process.join(5.0)
            raise first
        super().__init__(*first)
        # At exit (run before multiprocessing joins its children): the closed pipe stops the engine process.
        atexit.register(self._close)
        # Sends leave the event loop's thread at once: a long prompt's pickle never waits on the pipe there.
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._gc_pauses: PauseLog | None = None  # as of the engine process's last message
        self._threads = [threading.Thread(target=self._write, daemon=True, name="goodserve-to-engine"),
                         threading.Thread(target=self._read, daemon=True, name="goodserve-from-engine")]

    def gc_pauses(self) -> PauseLog | None:
        return self._gc_pauses

    async def start(self) -> None:
        if self._threads[0].ident is None:
            freeze_startup_heap()
            tune_for_serving()
            for thread in self._threads:
                thread.start()

    async def _stop(self) -> None:
        self._outbox.put(_STOP)
        await asyncio.to_thread(self.process.join, _STOP_TIMEOUT_S)
        if self.process.is_alive():
            logger.warning("the engine process did not stop in time: killed")
            self.process.kill()
        self._close()
        atexit.unregister(self._close)  # else the exit hook keeps a stopped engine (and what it holds) alive

    def _close(self) -> None:
        self.stopping.set()
        self._conn.close()

    def _submit(self, command: _Add | _Abort) -> None:
        self._outbox.put(replace(command, stream=None) if isinstance(command, _Add) else command)

    # ---- the pipe (its own threads) ------------------------------------------------------
    def _write(self) -> None:
        try:
            send_from(self._outbox, self._conn, _STOP, self._with_grammar, self._refuse)
        except BaseException as exc:  # a bug here: say so on /health rather than hang every later request
            logger.exception("the link to the engine process broke")
            self._fail_all(EngineDeadError(f"the link to the engine process broke: {type(exc).__name__}"))

    def _with_grammar(self, message):
        """An add with its grammar compiled here (validating it did, on the server's grammar thread):
        the engine's step loop loads it instead of compiling it again."""
        spec = message.params.structured_outputs if isinstance(message, _Add) else None
        return message if spec is None else replace(message, grammar=self.inputs.grammars.serialized(spec))

    def _refuse(self, message, exc: Exception) -> None:
        """A message that could not be sent fails its own request; the others go on."""
        if isinstance(message, _Add):
            if not isinstance(exc, GoodserveError):
                logger.error("request %s could not be sent to the engine process: %r", message.request_id, exc)
                exc = EngineStepError(f"this request could not be sent to the engine: {type(exc).__name__}")
            self._deliver([Failed(message.request_id, exc)])
        else:
            logger.error("could not send %r to the engine process: %r", message, exc)

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if isinstance(message, BaseException):
                    raise message
                items, self._stats, self._forecast, self._gc_pauses = message
                self._deliver(items)
        except (EOFError, OSError):
            if not self.stopping.is_set():
                self.process.join(1.0)
                dead = EngineDeadError(f"the engine process (pid {self.process.pid}) exited with "
                                       f"{self.process.exitcode}")
                logger.error("%s: every request now fails with 503 (as GET /health says); restart the server", dead)
                self._fail_all(dead)
        except BaseException as exc:  # the engine loop died; the process reported why
            logger.error("engine loop died: %s", exc)
            self._fail_all(exc)


def send_from(outbox: queue.SimpleQueue, conn: Connection, last, prepare=None, refuse=None) -> None:
    """Send what comes into the outbox (each as prepare(message) makes it) until `last` has gone, or the
    other side has (whose reader reports that). With refuse, a message that cannot be prepared or
    pickled (a value nested past the recursion limit, ...) goes to refuse(message, exc) and the rest go
    on: pickling comes before any byte is written, so the pipe stays whole."""
    while True:
        message = outbox.get()
        try:
            conn.send(message if prepare is None else prepare(message))
        except OSError:
            return
        except Exception as exc:
            if refuse is None:
                raise
            refuse(message, exc)
        if message == last:
            return


# ---- the engine process --------------------------------------------------------------------
def run_engine_process(conn: Connection, config: EngineConfig, log_level: int) -> None:
    from goodserve.engine.frontend.engine import Engine  # torch and the model: this process only

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    leave_stopping_to_the_parent()  # the serving process drains first, then says stop
    try:
        engine = Engine(config)
    except BaseException as exc:  # noqa: BLE001 - raised where the engine was asked for (a bad model path, ...)
        conn.send(exc)
        return
    conn.send((EngineInfo.of(engine), engine.stats(), engine.scheduler.forecast()))
    freeze_startup_heap()
    tune_for_serving()
    try:
        _serve(conn, engine, watch_pauses())
    except (EOFError, OSError):  # the serving process is gone: nothing to answer
        pass
    except BaseException as exc:
        logger.exception("engine loop died")
        conn.send(EngineDeadError(str(exc) or type(exc).__name__))
    finally:
        for request_id in list(engine.requests):
            engine.abort_request(request_id)
        engine.executor.shutdown()  # its ranks ignore SIGTERM, multiprocessing's way at exit


def _serve(conn: Connection, engine, pauses: PauseLog) -> None:
    """Commands in, one message a step out, until the serving process says stop."""
    while True:
        failed = []
        timeout = 0.0 if engine.has_unfinished() else _IDLE_WAIT_S
        while conn.poll(timeout):
            command = conn.recv()
            if command == _STOP:
                return
            error = apply_command(engine, command)
            if error is not None:
                failed.append(Failed(command.request_id, error))
            timeout = 0.0
        outputs = engine.step() if engine.has_unfinished() else []
        conn.send((failed + [_for_the_wire(o) for o in outputs], engine.stats(), engine.scheduler.forecast(), pauses))


def _for_the_wire(output: RequestOutput) -> RequestOutput:
    """A running request's output without the prompt's ids and the token times (see the module's doc)."""
    if output.finished:
        return output
    m = output.metrics
    return replace(output, prompt_token_ids=[], metrics=RequestMetrics(
        m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time,
        num_preemptions=m.num_preemptions))
