"""The engine behind the server: a background thread runs step() in a loop; asyncio callers stream.

All engine state is touched by that one thread only. Callers hand it work through a command queue
(add, abort) and receive each step's outputs on their event loop: `add` hands each to a callback of
the caller's (the server's GenerationJob puts them straight into its own queue: one hop a token),
`generate` streams them through a queue of its own. The HTTP event loop never waits on model compute.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from goodserve.config import EngineConfig
from goodserve.engine.engine import Engine
from goodserve.engine.gc_pauses import freeze_startup_heap, tune_for_serving, unfreeze_heap
from goodserve.engine.slo_policy import SloForecast
from goodserve.engine.stats import EngineStats
from goodserve.errors import EngineDeadError, EngineStepError, GoodserveError
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
    stream: "_Stream"


@dataclass
class _Abort:
    request_id: str


Deliver = Callable[[RequestOutput | BaseException], None]


class _Stream:
    """Delivers one request's outputs (or its error) from the engine thread to its caller's event loop;
    an output the engine failed arrives as EngineStepError."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deliver: Deliver) -> None:
        self.loop = loop
        self.deliver = deliver
        self.finished = False  # its last item is on its way: nothing left to abort

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput) and item.error is not None:
            item = EngineStepError(f"the engine failed on this request: {item.error}")
        self.finished = self.finished or isinstance(item, BaseException) or item.finished
        self.loop.call_soon_threadsafe(self.deliver, item)


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, engine: Engine | None = None) -> None:
        self.engine = engine or Engine(config or EngineConfig())
        self.config = self.engine.config
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, _Stream] = {}
        self.thread: threading.Thread | None = None
        self.stopping = threading.Event()
        self.dead: BaseException | None = None
        self._stats = self.engine.stats()
        self._forecast = self.engine.scheduler.forecast()

    # ---- what the server reads -----------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def spec(self):
        return self.engine.spec

    @property
    def dtype(self):
        return self.engine.dtype

    @property
    def device(self):
        return self.engine.device

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> EngineStats:
        """The stats as of the last step (refreshed by the engine thread; safe to read anywhere)."""
        return self._stats

    def prefill_stats(self) -> EngineStats | None:
        """A separate prefill engine's stats (server/disaggregated.py); None: this engine prefills."""
        return None

    def forecast(self) -> SloForecast:
        """The step-time fit and queue shape as of the last step (published by the engine thread)."""
        return self._forecast

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        return self.engine.inputs.validate_request(prompt_token_ids, params)

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        if self.thread is None:
            freeze_startup_heap()
            tune_for_serving()
            self.thread = threading.Thread(target=self._loop, name="goodserve-engine", daemon=True)
            self.thread.start()

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Let running requests finish (up to the timeout), then stop the loop and abort the rest."""
        deadline = time.monotonic() + drain_timeout_s
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.stopping.set()
        if self.thread is not None:
            await asyncio.to_thread(self.thread.join, 10.0)
            unfreeze_heap()

    # ---- requests ------------------------------------------------------------------------
    def add(self, request_id: str, prompt: str | list[int], params: SamplingParams, deliver: Deliver) -> None:
        """Start a request: deliver(item) is called on this event loop with its output after every step
        it took part in (all of it so far, or what the step added: SamplingParams.output_kind), the last
        one finished, or with the exception that ended it. The caller calls release() when it takes no
        more."""
        if self.dead is not None or self.stopping.is_set():
            raise EngineDeadError(f"the engine is not running{f': {self.dead}' if self.dead else ''}")
        stream = _Stream(asyncio.get_running_loop(), deliver)
        self.streams[request_id] = stream
        self.commands.put(_Add(request_id, prompt, params, time.time(), stream))

    def release(self, request_id: str) -> None:
        """The caller takes no more of the request's outputs: if it has not finished (the client went
        away, a cancellation, an error), abort it. Safe to call more than once."""
        stream = self.streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            self.commands.put(_Abort(request_id))

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
            self.dead = exc
            for stream in list(self.streams.values()):
                stream.put(EngineDeadError(f"the engine stopped: {exc}"))
        finally:
            for request_id in list(self.engine.requests):
                self.engine.abort_request(request_id)

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
        if isinstance(command, _Abort):
            self.engine.abort_request(command.request_id)
            return
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params, command.arrival_time)
        except GoodserveError as exc:
            command.stream.put(exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self.streams.get(output.request_id)
            if stream is None:  # the caller left between the step and now
                if not output.finished:
                    self.engine.abort_request(output.request_id)
                continue
            stream.put(output)
