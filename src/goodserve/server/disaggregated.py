"""`goodserve serve --disaggregate prefill:0,decode:1`: the server's engine decodes here, in the server
process, and a child process (engine/disagg/prefill_worker.py) prefills. A request goes to the prefill side
over a pipe; its KV comes back block by block over torch.distributed (engine/disagg/kv_transfer.py) and is
decoded here. The exchange runs on a thread of its own: the engine thread only reserves the blocks
(and later admits the request, or gives them back), so the decodes here never wait on a transfer.
The first output token is sampled here, by the decode engine computing the prompt's last token on
arrival, so TTFT counts the prefill, the transfer and one decode step (the request's arrival time
travels with it).

Where the KV does not arrive, the request is prefilled here instead (local prefill), so the client is
answered either way: the prefill side refused it (a prompt its pool cannot hold) or failed it, or this
engine had no room for the blocks when they came. Requests that need the prompt's own logits or hidden
states (prompt_logprobs, embeddings), n > 1, or one-token prompts are prefilled here from the start.

An abort here (client disconnect) while the prefill side has the request tells it to abort: its
exchange then moves nothing and frees its blocks; blocks that arrive for a request no longer wanted are
freed on arrival. A prefill process that exits fails the requests it had with 503 and the server
answers 503 (and /health 503) from then on; requests already decoding here finish.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from goodserve.config import EngineConfig
from goodserve.engine.frontend.async_engine import AsyncEngine, _Abort, _Add
from goodserve.engine.frontend.engine_process import send_from
from goodserve.engine.disagg.disagg_layout import DisaggLayout, cuda_visible
from goodserve.engine.disagg.kv_transfer import kv_layers, receive_blocks, receive_header, refuse
from goodserve.engine.frontend.request import Request
from goodserve.engine.disagg.prefill_worker import DECODE_RANK, PREFILL_RANK, join_group, prefill_worker_main
from goodserve.engine.core.stats import EngineStats
from goodserve.engine.processes.stop_signals import kill_at_exit
from goodserve.errors import EngineDeadError, GoodserveError, InvalidRequestError
from goodserve.server.process import free_port

logger = logging.getLogger("goodserve.disaggregated")

STOP_TIMEOUT_S = 30.0


@dataclass
class _Reserve:  # the receiving thread asks the engine thread for blocks for the prompt's KV
    request_id: str
    prompt_token_ids: list[int]
    reply: Future  # (the reserved request, its block table), or None (not wanted any more, no room, refused)


@dataclass
class _Arrived:  # the blocks were filled (error None) or not
    request_id: str
    request: Request
    error: BaseException | None


@dataclass
class _NotSent:  # the prefill side ended the request before its prompt was computed
    request_id: str


@dataclass
class _Refused:
    request_id: str
    reason: str


@dataclass
class _PrefillExited:
    reason: str


def _set_env(name: str, value: str | None) -> None:
    if value is not None:
        os.environ[name] = value


def start_prefill_process(config: EngineConfig, layout: DisaggLayout):
    """The prefill child on its GPU (or its share of the CPU cores), joined with this process's group."""
    prefill_gpu, decode_gpu = cuda_visible(layout, config.device)
    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    saved = {name: os.environ.get(name) for name in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")}
    # A spawned child takes this process's environment as it is when started.
    _set_env("CUDA_VISIBLE_DEVICES", prefill_gpu)
    if prefill_gpu is None and saved["OMP_NUM_THREADS"] is None:  # the CPU's cores split between the two
        half = max(1, (os.cpu_count() or 1) // 2)
        os.environ["OMP_NUM_THREADS"] = str(half)
        torch.set_num_threads(half)
    # its steps traced to a file of their own: two engines appending to one would interleave their steps
    trace = f"{config.step_trace}.prefill" if config.step_trace else None
    process = ctx.Process(target=prefill_worker_main, args=(replace(config, step_trace=trace), child_conn, init_method),
                          name="goodserve-prefill", daemon=True)
    try:
        process.start()
        kill_at_exit(process)
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            _set_env(name, value)
    _set_env("CUDA_VISIBLE_DEVICES", decode_gpu)  # before this process touches CUDA
    child_conn.close()
    logger.info("prefill worker: pid %d%s", process.pid,
                f" (CUDA_VISIBLE_DEVICES={prefill_gpu})" if prefill_gpu is not None else " (CPU)")
    join_group(config, init_method, DECODE_RANK)
    return process, parent_conn


class DisaggregatedEngine(AsyncEngine):
    def __init__(self, config: EngineConfig, layout: DisaggLayout) -> None:
        if config.executor_backend != "uni":
            raise InvalidRequestError("--disaggregate needs --executor-backend uni (the KV pools in the engines' "
                                      "processes)")
        self.process, self.conn = start_prefill_process(config, layout)
        try:
            _, self._prefill_stats = self.conn.recv()  # its engine is built
        except EOFError:
            self.process.join(5.0)
            raise EngineDeadError(f"the prefill worker exited with {self.process.exitcode} while starting "
                                  f"(its log is above)") from None
        super().__init__(config)
        self.prefilling: dict[str, _Add] = {}  # engine thread only
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.exchanges: queue.SimpleQueue = queue.SimpleQueue()  # ids whose KV exchange is next on the group
        threading.Thread(target=self._write, daemon=True, name="goodserve-to-prefill").start()
        threading.Thread(target=self._read, daemon=True, name="goodserve-from-prefill").start()
        threading.Thread(target=self._receive_kv, daemon=True, name="goodserve-kv-receiver").start()

    def prefill_stats(self) -> EngineStats:
        """The prefill engine's stats as it last reported them."""
        return self._prefill_stats

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        await super().shutdown(drain_timeout_s)
        self.outbox.put(("stop",))
        self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            logger.warning("the prefill worker did not stop in time: killed")
            self.process.kill()
        atexit.unregister(self.process.kill)
        dist.destroy_process_group()

    # ---- the pipe (its own threads: the engine thread never waits on it) ----------------------
    def _write(self) -> None:
        send_from(self.outbox, self.conn, ("stop",))

    def _read(self) -> None:
        try:
            while True:
                kind, *rest = self.conn.recv()
                if kind == "stats":
                    self._prefill_stats = rest[0]
                elif kind == "prefilled":
                    self.exchanges.put(rest[0])
                else:
                    self.commands.put(_Refused(*rest))
        except (EOFError, OSError):
            if self.stopping.is_set():
                return
            self.process.join(1.0)
            reason = f"the prefill worker (pid {self.process.pid}) exited with {self.process.exitcode}"
            logger.error("%s; new requests get 503", reason)
            self.dead = EngineDeadError(reason)
            self.commands.put(_PrefillExited(reason))

    # ---- the KV exchanges, in the order the prefill side makes them -------------------------
    def _receive_kv(self) -> None:
        """Header and prompt, blocks reserved by the engine thread, then the blocks put in place here
        while the engine steps on. A failed group (the prefill side gone) ends the thread: _read
        reports the exit."""
        layers = kv_layers(self.engine)
        while True:
            request_id = self.exchanges.get()
            request = None
            try:
                incoming = receive_header(layers, PREFILL_RANK)
                if incoming is None:
                    self.commands.put(_NotSent(request_id))
                    continue
                reply = Future()
                self.commands.put(_Reserve(request_id, incoming.prompt_token_ids, reply))
                reserved = reply.result()
                if reserved is None:
                    refuse(layers, PREFILL_RANK)
                    continue
                request, table = reserved
                receive_blocks(layers, incoming, self.config.block_size, table, PREFILL_RANK)
                self.commands.put(_Arrived(request_id, request, None))
            except GoodserveError as exc:  # blocks this engine cannot take (another model or block size)
                self.commands.put(_Arrived(request_id, request, exc))
            except RuntimeError as exc:  # the group failed mid-exchange: the prefill side is gone
                self.commands.put(_Arrived(request_id, request, EngineDeadError(
                    f"the KV transfer from the prefill worker failed: {exc}")))
                return

    # ---- the engine thread ---------------------------------------------------------------
    def _apply(self, command) -> None:
        if isinstance(command, _Add):
            self._prefill_there(command)
        elif isinstance(command, _Abort) and command.request_id in self.prefilling:
            self.outbox.put(("abort", command.request_id))
        elif isinstance(command, _Reserve):
            command.reply.set_result(self._reserve(command))
        elif isinstance(command, _Arrived):
            self._arrived(command)
        elif isinstance(command, _NotSent) and command.request_id in self.prefilling:
            self._prefill_here(self.prefilling.pop(command.request_id),
                               "the prefill side ended it before its prompt was computed")
        elif isinstance(command, _Refused):
            add = self.prefilling.pop(command.request_id)
            self._prefill_here(add, f"the prefill side refused it: {command.reason}")
        elif isinstance(command, _PrefillExited):
            for add in self.prefilling.values():
                add.stream.put(EngineDeadError(f"{command.reason} before this request started"))
            self.prefilling.clear()
        else:
            super()._apply(command)

    def _prefill_there(self, add: _Add) -> None:
        try:
            if add.request_id in self.prefilling or add.request_id in self.engine.requests:
                raise InvalidRequestError(f"request id {add.request_id!r} is already in use")
            if self.dead is not None:
                raise EngineDeadError(str(self.dead))
            prompt_ids = self.engine.inputs.tokenize_prompt(add.prompt)[1]
            self.engine.inputs.validate_request(prompt_ids, add.params)
        except GoodserveError as exc:
            add.stream.put(exc)
            return
        p = add.params
        if p.n != 1 or p.prompt_logprobs is not None or p.pooling is not None or len(prompt_ids) < 2:
            super()._apply(add)  # needs the prompt computed here (or there is nothing to move)
            return
        self.prefilling[add.request_id] = add
        self.outbox.put(("add", add.request_id, prompt_ids))

    def _reserve(self, command: _Reserve) -> tuple[Request, list[int]] | None:
        """Blocks for the request's KV, if it is still wanted; where there is no room, it is prefilled
        here (None: the receiving thread refuses the blocks)."""
        add = self.prefilling.get(command.request_id)
        if add is None or command.request_id not in self.streams:
            self.prefilling.pop(command.request_id, None)
            return None
        try:
            request = self.engine.reserve_decode_request(command.request_id, command.prompt_token_ids, add.params,
                                                         add.arrival_time)
        except GoodserveError as exc:
            self.prefilling.pop(command.request_id)
            add.stream.put(exc)
            return None
        if request is None:
            self._prefill_here(self.prefilling.pop(command.request_id), "no room here for its KV when it came")
            return None
        return request, list(self.engine.reserved_blocks(request))

    def _arrived(self, command: _Arrived) -> None:
        """Admit a request whose blocks are filled and still wanted; otherwise give them back."""
        add = self.prefilling.pop(command.request_id, None)
        if command.request is not None and (command.error is not None or add is None
                                            or command.request_id not in self.streams):
            self.engine.release_decode_request(command.request)
        elif command.request is not None:
            self.engine.admit_decode_request(command.request)
        if command.error is not None and add is not None:
            add.stream.put(command.error)

    def _prefill_here(self, add: _Add, why: str) -> None:
        if add.request_id in self.streams:
            logger.info("%s prefilled here: %s", add.request_id, why)
            super()._apply(add)

