"""What tests reach inside an engine for, in one place; and a server in the test's own process.

A test about the server, a kernel or the scheduler that needs the loaded model, its runner or the
worker processes asks here, never `llm.engine.executor.worker.runner...` itself: when the engine's
inner shape changes, this file changes and those tests do not. Each function takes an LLM or an
Engine.
"""

from __future__ import annotations

import gc
import logging
import tempfile
import threading
import time

import torch

from goodserve.engine.frontend.engine import Engine
from goodserve.llm import LLM
from goodserve.ports import free_port

# A request to a server a test started: generous, since the machine may be busy with other work
# (httpx's default, 5 s, is a speed assertion there).
HTTP_TIMEOUT_S = 300


def engine_of(target: LLM | Engine) -> Engine:
    return target.engine if isinstance(target, LLM) else target


def executor_of(target: LLM | Engine):
    """The executor: the engine's one seam to its workers (execute_model, sample_tokens, shutdown)."""
    return engine_of(target).executor


def runner_of(target: LLM | Engine):
    """The ModelRunner of an engine whose worker runs in this process (no tensor or pipeline parallelism)."""
    return executor_of(target).worker.runner


def drafter_of(target: LLM | Engine):
    """The runner's drafter (engine/worker/drafter.py: a draft model's proposals, in the worker) of an
    engine whose worker runs in this process."""
    return runner_of(target).drafter


def proposer_of(target: LLM | Engine):
    """The engine's proposer (engine/spec_decode/proposer.py): what a draft model or lookahead keeps
    per sequence; a draft model's is the drafter's in the worker (one in this process)."""
    proposer = engine_of(target).scheduler.speculator.proposer
    return proposer if proposer is not None else drafter_of(target).proposer


def set_proposer(target: LLM | Engine, proposer) -> None:
    """Replace the engine's host proposer (one that proposes scripted drafts)."""
    engine_of(target).scheduler.speculator.proposer = proposer


def loaded_model(target: LLM | Engine) -> torch.nn.Module:
    """The model as loaded and quantized (its layers, kernels and native decode stack)."""
    return runner_of(target).model


def worker_processes(target: LLM | Engine) -> list:
    """The worker (rank) processes of an engine whose executor runs them, rank 0 first."""
    return executor_of(target)._processes


def shut_down(target: LLM | Engine) -> None:
    """Stop the engine's worker processes (if any) and release what they hold."""
    executor_of(target).shutdown()


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding with HF's own KV cache, never stopping at EOS."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    tokens = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


class InProcessServer:
    """`goodserve serve ARGS` in this process: the app, its connection guards and the engine (on a
    thread, unless ARGS say --engine-process) behind uvicorn on a free loopback port, served from a
    thread. For tests of the HTTP surface, where the server's process is not the subject: no
    interpreter to start, and the same url / log() / stop() as a server process
    (goodserve.server.process.ServerProcess), which the tests of signals and deaths keep."""

    def __init__(self, args: list[str], timeout_s: float = 180.0) -> None:
        from goodserve.cli import build_parser
        from goodserve.engine_args import dataclass_from_args, engine_config_from_args
        from goodserve.server.app import ServerConfig, build_server

        self._data_dir = tempfile.TemporaryDirectory(prefix="goodserve-data-")
        # A quarter of the CPU's default KV pool (5,000 tokens of the embedded model): the test's
        # process holds this server's engine beside its own references.
        namespace = build_parser().parse_args(["serve", "--no-engine-process", "--data-dir", self._data_dir.name,
                                               "--cpu-kv-cache-bytes", str(256 << 20), "--port", str(free_port()),
                                               *args])
        config = dataclass_from_args(ServerConfig, namespace)
        self.url = f"http://127.0.0.1:{config.port}"
        self._records: list[str] = []
        self._capture = _ListHandler(self._records)
        self._logger = logging.getLogger("goodserve")
        self._saved_level = self._logger.level
        self._logger.setLevel(config.log_level.upper())
        self._logger.addHandler(self._capture)
        if config.engine_process:
            from goodserve.engine.frontend.engine_process import EngineProcess as engine_class
        else:
            from goodserve.engine.frontend.async_engine import AsyncEngine as engine_class
        self.server = build_server(engine_class(engine_config_from_args(namespace)), config)
        self._thread = threading.Thread(target=self.server.run, name="in-process-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the in-process server did not start:\n{self.log()[-4000:]}")
            time.sleep(0.05)

    @property
    def app(self):
        """The FastAPI app, for a test that must hold the server's own work at a known point."""
        return self.server.goodserve_app

    def log(self) -> str:
        return "\n".join(self._records)

    def stop(self) -> None:
        """Drain and stop, as on SIGTERM: in-flight requests finish, then the engine shuts down."""
        self.server.should_exit = True
        self._thread.join(120)
        # FastAPI caches each route's endpoint, a closure over the engine, for the life of the process:
        # let go of the stopped engine's model and KV cache, or every server of a test run stays loaded.
        vars(self.app.state.ctx.engine).clear()
        gc.collect()
        self._logger.removeHandler(self._capture)
        self._logger.setLevel(self._saved_level)
        self._data_dir.cleanup()

    def __enter__(self) -> "InProcessServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class _ListHandler(logging.Handler):
    def __init__(self, records: list[str]) -> None:
        super().__init__()
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record))


def wait_for_metrics(url: str, done, timeout_s: float = 120.0) -> dict[str, float]:
    """The server's /metrics, scraped until done(metrics) holds (a generous deadline, never a sleep)."""
    from goodserve.server.process import scrape_metrics

    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape_metrics(url)
        if done(metrics):
            return metrics
        assert time.monotonic() < deadline, f"timed out: {metrics}"
        time.sleep(0.1)
