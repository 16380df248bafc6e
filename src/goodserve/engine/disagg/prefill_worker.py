"""The prefill half of a disaggregated server: a child process whose engine computes each prompt's KV
and sends it to the decode engine (engine/disagg/kv_transfer.py) over the torch.distributed group the two
share; requests and news cross a multiprocessing pipe.

From the decode side:   ("add", request_id, prompt token ids), ("abort", request_id), ("stop",)
To the decode side:     ("started", stats)       its engine is built
                        ("refused", id, message) it cannot take the request (nothing follows)
                        ("prefilled", id)        a send_prefilled exchange for id follows on the group
                        ("stats", stats)         its EngineStats, when they changed
Every "add" is answered by exactly one "refused" or "prefilled" (an aborted request's exchange says
ABORTED and moves nothing), so both sides take the group's messages in the same order. The pipe is
read by a thread of its own: this process never stops draining it while a send waits on the decode
side, which would deadlock a decode side blocked on a full pipe.

The exchanges run on a thread of their own too (`Handover`), one after another in the order the
engine finished the prompts, so the engine prefills the next prompts while one's KV crosses. Done
one exchange at a time, the engine waited out each (the decode side takes it between its decode
steps, then the bytes move): on two H100s, 1 prefill + 1 decode GPU held 2k-token prompts at 6.4
req/s (benchmarks/BENCHMARKS.md, disaggregation; how much of that the wait was is not measured).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from goodserve.config import EngineConfig
from goodserve.engine.frontend.engine import Engine
from goodserve.engine.processes.gc_pauses import freeze_startup_heap
from goodserve.engine.disagg.kv_transfer import kv_layers, send_held
from goodserve.engine.processes.stop_signals import leave_stopping_to_the_parent
from goodserve.errors import GoodserveError
from goodserve.sampling_params import SamplingParams

logger = logging.getLogger("goodserve.prefill")

DECODE_RANK, PREFILL_RANK = 0, 1
GROUP_TIMEOUT = timedelta(minutes=5)  # a peer that vanished mid-exchange fails the exchange, not hangs it
_IDLE_WAIT_S = 0.05
_CLOSE_WAIT_S = 5.0
# The first token is sampled again by the decode side (it computes the last prompt token itself).
FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


def kv_backend(config: EngineConfig) -> str:
    on_cpu = config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())
    return "gloo" if on_cpu else "nccl"


def join_group(config: EngineConfig, init_method: str, rank: int) -> None:
    dist.init_process_group(kv_backend(config), init_method=init_method, rank=rank, world_size=2,
                            timeout=GROUP_TIMEOUT)


def _read(conn, inbox: queue.SimpleQueue) -> None:
    try:
        while True:
            inbox.put(conn.recv())
    except (EOFError, OSError):  # the decode side is gone: stop
        inbox.put(("stop",))


def prefill_worker_main(config: EngineConfig, conn, init_method: str) -> None:
    leave_stopping_to_the_parent()  # the decode side drains first, then says stop
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    join_group(config, init_method, PREFILL_RANK)
    try:
        engine = Engine(config)
        freeze_startup_heap()
        conn.send(("started", engine.stats()))
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_read, args=(conn, inbox), daemon=True, name="prefill-pipe").start()
        PrefillLoop(engine, _LockedPipe(conn), inbox).run()
    except (BrokenPipeError, EOFError):  # the decode side is gone: nothing left to serve
        pass
    finally:
        dist.destroy_process_group()


class _LockedPipe:
    """The pipe's sending end, shared by the loop and the handover thread."""

    def __init__(self, conn):
        self.conn, self.lock = conn, threading.Lock()

    def send(self, message) -> None:
        with self.lock:
            self.conn.send(message)


class Handover:
    """The exchanges with the decode side (engine/disagg/kv_transfer.send_held), on a thread of their own, in
    the order given. The blocks stay held until an exchange ends; the loop then releases them (the
    engine is the loop's alone). On CUDA the blocks are gathered on a stream of the thread's own, so
    the engine's next steps do not wait behind them."""

    def __init__(self, engine: Engine, conn: _LockedPipe):
        self.layers, self.block_size, self.conn = kv_layers(engine), engine.config.block_size, conn
        device = self.layers[0].k.device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.todo: queue.SimpleQueue = queue.SimpleQueue()
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, daemon=True, name="prefill-handover")
        self.thread.start()

    def put(self, request_id: str, prompt_token_ids: list[int], held: tuple[list[int], int]) -> None:
        self.todo.put((request_id, prompt_token_ids, held))

    def finished(self) -> list[str]:
        """The requests whose exchange ended since the last call (their blocks may go back); an
        exchange that failed (the group is broken: the decode side is gone) raises here."""
        ended = []
        while not self.done.empty():
            request_id, error = self.done.get_nowait()
            if error is not None:
                raise error
            ended.append(request_id)
        return ended

    def close(self) -> None:
        """Let the exchanges already given end (briefly: a decode side that stopped takes none)."""
        self.todo.put(None)
        self.thread.join(_CLOSE_WAIT_S)

    def _run(self) -> None:
        while (item := self.todo.get()) is not None:
            request_id, prompt_token_ids, held = item
            try:
                self.conn.send(("prefilled", request_id))
                with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                    send_held(self.layers, held, self.block_size, prompt_token_ids, DECODE_RANK)
                if self.stream is not None:
                    self.stream.synchronize()  # the gathers read the blocks: done before they go back
                self.done.put((request_id, None))
            except BaseException as exc:  # noqa: BLE001 - the loop raises it
                self.done.put((request_id, exc))
                return


class PrefillLoop:
    def __init__(self, engine: Engine, conn: _LockedPipe, inbox: queue.SimpleQueue):
        self.engine, self.conn, self.inbox = engine, conn, inbox
        self.handover = Handover(engine, conn)
        self.published = None

    def run(self) -> None:
        try:
            while True:
                for message in self._messages(block=not self.engine.has_unfinished()):
                    if message[0] == "stop":
                        return
                    self._apply(*message)
                self._release_handed_over()
                self._publish_stats()  # what it took on shows while the step runs
                if self.engine.has_unfinished():
                    for out in self.engine.step(finished_only=True):
                        self._hand_over(out.request_id, out.prompt_token_ids)
                self._publish_stats()
        finally:
            self.handover.close()

    def _release_handed_over(self) -> None:
        for request_id in self.handover.finished():
            self.engine.release_held(request_id)

    def _messages(self, block: bool) -> list[tuple]:
        try:
            messages = [self.inbox.get(timeout=_IDLE_WAIT_S) if block else self.inbox.get_nowait()]
        except queue.Empty:
            return []
        while not self.inbox.empty():
            messages.append(self.inbox.get_nowait())
        return messages

    def _apply(self, kind: str, request_id: str, *rest) -> None:
        if kind == "add":
            try:
                self.engine.add_prefill_request(request_id, rest[0], FIRST_TOKEN)
            except GoodserveError as exc:  # e.g. a prompt this engine's pool can never hold
                self.conn.send(("refused", request_id, str(exc)))
        elif kind == "abort":
            aborted = self.engine.abort_request(request_id)
            if aborted is not None:  # not yet handed over: its exchange says ABORTED, frees its blocks
                self._hand_over(request_id, aborted.prompt_token_ids)

    def _hand_over(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self.handover.put(request_id, prompt_token_ids, self.engine.held_kv(request_id))

    def _publish_stats(self) -> None:
        stats = self.engine.stats()
        shape = (stats.num_used_kv_blocks, stats.num_running, stats.num_waiting)
        if shape != self.published:
            self.published = shape
            self.conn.send(("stats", stats))
