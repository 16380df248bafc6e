"""The engine behind the server, and the handle callers hold on it (EngineClient).

AsyncEngine runs the engine on a background thread of the caller's process: step() in a loop. All
engine state is touched by that one thread only. Callers hand it work through a command queue (add,
abort) and receive each step's outputs on their event loop: `add` hands each to a callback of the
caller's (the server's GenerationJob puts them straight into its own queue: one hop a token),
`generate` streams them through a queue of its own. The HTTP event loop never waits on model compute.
engine/frontend/engine_process.py runs the same loop in a process of its own, behind the same handle.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from goodserve.config import EngineConfig
from goodserve.engine.frontend.engine import Engine
from goodserve.engine.core.forecast import Forecast
from goodserve.engine.frontend.input_processor import InputProcessor
from goodserve.engine.processes.gc_pauses import PauseLog, freeze_startup_heap, tune_for_serving, unfreeze_heap
from goodserve.engine.core.stats import EngineStats
from goodserve.errors import EngineDeadError, EngineStepError, GoodserveError, InvalidRequestError
from goodserve.model.spec import ModelSpec
from goodserve.model.tokenizer import Tokenizer
from goodserve.outputs import RequestOutput
from goodserve.sampling_params import SamplingParams

logger = logging.getLogger("goodserve.engine")

_IDLE_WAIT_S = 0.05


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    stream: "_Stream | None"  # None where the command crosses to another process
    grammar: str | None = None  # its grammar compiled by the caller (GrammarCompiler.serialized), if it crosses


@dataclass
class _Abort:
    request_id: str


@dataclass
class Failed:
    """A request the engine refused when it came (a duplicate id, a grammar it cannot compile)."""

    request_id: str
    error: GoodserveError


Deliver = Callable[[RequestOutput | BaseException], None]


class _Stream:
    """Delivers one request's outputs (or its error) from the engine's side to its caller's event loop;
    an output the engine failed arrives as EngineStepError."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deliver: Deliver) -> None:
        self.loop = loop
        self.deliver = deliver
        self.finished = False  # its last item is on its way: nothing left to abort

    def item(self, item: RequestOutput | BaseException) -> RequestOutput | BaseException:
        """What the caller gets for item; marks the stream finished with its last one."""
        if isinstance(item, RequestOutput) and item.error is not None:
            item = EngineStepError(f"the engine failed on this request: {item.error}")
        self.finished = self.finished or isinstance(item, BaseException) or item.finished
        return item

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.deliver, self.item(item))


@dataclass
class EngineInfo:
    """What a caller reads about the engine it holds, fixed once the engine is built (plain data)."""

    config: EngineConfig  # resolved: no "auto" left in it
    spec: ModelSpec
    tokenizer: Tokenizer | None
    dtype: torch.dtype
    device: torch.device
    device_name: str  # read where the engine runs: asking CUDA in the server's process would start it there
    cuda_graphs: bool
    micro_batches: bool
    cpu_threads: int  # the engine process's torch threads (each rank's, under tensor parallelism)

    @classmethod
    def of(cls, engine: Engine) -> "EngineInfo":
        device = engine.device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        return cls(engine.config, engine.spec, engine.tokenizer, engine.dtype, device, name,
                   engine.executor.info.cuda_graphs, engine.micro_batches, torch.get_num_threads())


class EngineClient:
    """A handle on an engine that runs elsewhere (a thread, a process): requests in, each one's
    outputs out to its caller's event loop, and the engine's stats as of its last step."""

    runs_in_own_process = False

    def __init__(self, info: EngineInfo, stats: EngineStats, forecast: Forecast,
                 inputs: InputProcessor | None = None) -> None:
        self.info = info
        self.config, self.spec, self.tokenizer = info.config, info.spec, info.tokenizer
        self.dtype, self.device, self.max_model_len = info.dtype, info.device, info.config.max_model_len
        # validates on the caller's side (an engine in this process lends its own: one grammar cache)
        self.inputs = inputs or InputProcessor(info.config, info.spec, info.tokenizer)
        self.streams: dict[str, _Stream] = {}
        self.stopping = threading.Event()
        self.dead: BaseException | None = None
        self._stats, self._forecast = stats, forecast

    def stats(self) -> EngineStats:
        """The stats as of the last step (refreshed by the engine's side; safe to read anywhere)."""
        return self._stats

    def prefill_stats(self) -> EngineStats | None:
        """A separate prefill engine's stats (server/disaggregated.py); None: this engine prefills."""
        return None

    def forecast(self) -> Forecast:
        """The step-time fit and queue shape as of the last step (published by the engine's side)."""
        return self._forecast

    def gc_pauses(self) -> PauseLog | None:
        """The engine's process's garbage-collector pauses, where that is not the caller's."""
        return None

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        return self.inputs.validate_request(prompt_token_ids, params)

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        raise NotImplementedError

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Let running requests finish (up to the timeout), then stop the engine and abort the rest."""
        deadline = time.monotonic() + drain_timeout_s
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.stopping.set()
        await self._stop()

    async def _stop(self) -> None:
        raise NotImplementedError

    # ---- requests ------------------------------------------------------------------------
    def add(self, request_id: str, prompt: str | list[int], params: SamplingParams, deliver: Deliver) -> None:
        """Start a request: deliver(item) is called on this event loop with its output after every step
        it took part in (all of it so far, or what the step added: SamplingParams.output_kind), the last
        one finished, or with the exception that ended it. The caller calls release() when it takes no
        more."""
        if self.dead is not None or self.stopping.is_set():
            raise EngineDeadError(f"the engine is not running{f': {self.dead}' if self.dead else ''}")
        if request_id in self.streams:  # its outputs would go to this caller
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop(), deliver)
        self.streams[request_id] = stream
        self._submit(_Add(request_id, prompt, params, time.time(), stream))

    def release(self, request_id: str) -> None:
        """The caller takes no more of the request's outputs: if it has not finished (the client went
        away, a cancellation, an error), abort it. Safe to call more than once."""
        stream = self.streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            self._submit(_Abort(request_id))

    def _submit(self, command: _Add | _Abort) -> None:
        raise NotImplementedError

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as `add` delivers them; an error is raised."""
        outputs: asyncio.Queue = asyncio.Queue()
        self.add(request_id, prompt, params, outputs.put_nowait)
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.release(request_id)

    # ---- the engine's side ---------------------------------------------------------------
    def _deliver(self, items: list[RequestOutput | Failed]) -> None:
        """A step's outputs to their callers: one wake-up of each caller's event loop for all of them.
        An output whose caller has left is dropped: release() sent its abort."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for item in items:
            stream = self.streams.get(item.request_id)
            if stream is not None:
                batch = batches.setdefault(stream.loop, [])
                batch.append((stream.deliver, stream.item(item.error if isinstance(item, Failed) else item)))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_deliver_all, batch)

    def _fail_all(self, exc: BaseException) -> None:
        self.dead = exc
        for stream in list(self.streams.values()):
            stream.put(EngineDeadError(f"the engine stopped: {exc}"))


def _deliver_all(batch: list[tuple[Deliver, RequestOutput | BaseException]]) -> None:
    for deliver, item in batch:
        deliver(item)


def apply_command(engine: Engine, command: _Add | _Abort) -> GoodserveError | None:
    """Hand a caller's command to the engine; the error of an add the engine refuses."""
    if isinstance(command, _Abort):
        engine.abort_request(command.request_id)
        return None
    request_id, grammar = command.request_id, command.grammar
    try:
        if grammar is not None:
            engine.inputs.grammars.adopt(command.params.structured_outputs, grammar)
        engine.add_request(request_id, command.prompt, command.params, command.arrival_time)
    except GoodserveError as exc:
        return exc
    return None


class AsyncEngine(EngineClient):
    """The engine on a background thread of this process."""

    def __init__(self, config: EngineConfig | None = None, engine: Engine | None = None) -> None:
        self.engine = engine or Engine(config or EngineConfig())
        super().__init__(EngineInfo.of(self.engine), self.engine.stats(), self.engine.scheduler.forecast(),
                         self.engine.inputs)
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    async def start(self) -> None:
        if self.thread is None:
            freeze_startup_heap()
            tune_for_serving()
            self.thread = threading.Thread(target=self._loop, name="goodserve-engine", daemon=True)
            self.thread.start()

    async def _stop(self) -> None:
        if self.thread is not None:
            await asyncio.to_thread(self.thread.join, 10.0)
            unfreeze_heap()

    def _submit(self, command: _Add | _Abort) -> None:
        self.commands.put(command)

    # ---- the engine thread ---------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self.stopping.is_set():
                self._drain_commands(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self._deliver(self.engine.step())
                self._stats = self.engine.stats()
                self._forecast = self.engine.scheduler.forecast()
        except BaseException as exc:  # a bug in the loop itself: fail every caller, loudly
            logger.exception("engine loop died")
            self._fail_all(exc)
        finally:
            for request_id in list(self.engine.requests):
                self.engine.abort_request(request_id)
            self.engine.executor.shutdown()  # its ranks ignore SIGTERM, multiprocessing's way at exit

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self.commands.get(timeout=_IDLE_WAIT_S) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: _Add | _Abort) -> None:
        error = apply_command(self.engine, command)
        if error is not None:
            command.stream.put(error)
