"""`goodserve serve --data-parallel-size R`: R engine servers on loopback ports and the router in
front of them on the public port, under one command. On CUDA each replica gets its own GPU
(CUDA_VISIBLE_DEVICES); on the CPU they share it, its cores split between them. Ctrl-C or SIGTERM
stops the router, then lets each replica drain; a replica that dies is reported, and the router's
health checks (and the first request refused by it) take it out."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2

from goodserve.config import EngineConfig
from goodserve.cpu_threads import available_cores
from goodserve.engine_args import dataclass_argv
from goodserve.errors import InvalidRequestError
from goodserve.router.app import run_router
from goodserve.router.config import RouterConfig
from goodserve.server.app import ServerConfig
from goodserve.server.batch_store import default_data_dir
from goodserve.server.process import free_port

logger = logging.getLogger("goodserve.replicas")

STOP_GRACE_S = 10.0  # beyond a replica's own drain timeout, before it is killed
PR_SET_PDEATHSIG = 1


@dataclass
class Replica:
    index: int
    process: subprocess.Popen
    url: str

    def healthy(self) -> bool:
        try:
            return httpx2.get(f"{self.url}/health", timeout=1.0).status_code == 200
        except httpx2.TransportError:
            return False


def replica_gpus(device: str, replicas: int) -> list[str | None]:
    """Each replica's CUDA_VISIBLE_DEVICES: one GPU of those visible to this process, or None for all
    on the CPU (no GPU, or --device cpu). Fewer GPUs than replicas would put two engines, each
    sizing its KV pool to the whole GPU, on one card: refused."""
    if device == "cpu":
        return [None] * replicas
    import torch

    count = torch.cuda.device_count()
    if count == 0 and device == "auto":
        return [None] * replicas
    if count < replicas:
        raise InvalidRequestError(f"--data-parallel-size {replicas} needs {replicas} GPUs; {count} visible")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(count)]
    return ids[:replicas]


def replica_env(gpu: str | None, replicas: int, api_key: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    else:  # replicas on the CPU: each its share of the cores, not all of them each
        env.setdefault("OMP_NUM_THREADS", str(max(1, available_cores().count // replicas)))
    # The key travels in the environment (serve's default for --api-key), not in argv where ps shows it.
    env.pop("GOODSERVE_API_KEY", None)
    if api_key:
        env["GOODSERVE_API_KEY"] = api_key
    return env


def _die_with_parent() -> None:
    """In the child: SIGTERM when the launcher dies, even by SIGKILL, so no engine is orphaned."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_replica(index: int, engine: EngineConfig, server: ServerConfig, gpu: str | None,
                  replicas: int) -> Replica:
    port = free_port()
    data_dir = Path(server.data_dir) if server.data_dir else default_data_dir()
    # Each replica its own Batch API store (one server per data dir); the router does not relay batches.
    child = dataclasses.replace(server, host="127.0.0.1", port=port, api_key=None,
                                data_dir=str(data_dir / f"replica-{index}"))
    argv = [sys.executable, "-m", "goodserve.cli", "serve", *dataclass_argv(engine), *dataclass_argv(child)]
    # Its own session: a terminal's Ctrl-C reaches the launcher only, which stops the replicas in order.
    process = subprocess.Popen(argv, env=replica_env(gpu, replicas, server.api_key), start_new_session=True,
                               preexec_fn=_die_with_parent)
    replica = Replica(index, process, f"http://127.0.0.1:{port}")
    logger.info("replica %d: pid %d at %s%s", index, process.pid, replica.url,
                f" (CUDA_VISIBLE_DEVICES={gpu})" if gpu is not None else " (CPU)")
    return replica


def wait_ready(replicas: list[Replica]) -> None:
    """Until every replica's /health answers 200; a replica that exits first fails the launch."""
    waiting = list(replicas)
    while waiting:
        for replica in list(waiting):
            if replica.process.poll() is not None:
                raise InvalidRequestError(f"replica {replica.index} exited with {replica.process.returncode} "
                                          f"while starting (its log is above)")
            if replica.healthy():
                waiting.remove(replica)
        time.sleep(0.2)


class ReplicaSet:
    def __init__(self, drain_timeout_s: float):
        self.replicas: list[Replica] = []
        self.drain_timeout_s = drain_timeout_s
        self.stopping = threading.Event()

    def watch(self) -> None:
        """From now on a replica that exits is reported (while starting, its exit fails the launch)."""
        for replica in self.replicas:
            threading.Thread(target=self._watch, args=(replica,), daemon=True).start()

    def _watch(self, replica: Replica) -> None:
        code = replica.process.wait()
        if not self.stopping.is_set():
            logger.error("replica %d (pid %d, %s) exited with %s; the router takes it out", replica.index,
                         replica.process.pid, replica.url, code)

    def stop(self) -> None:
        """SIGTERM to all (each drains its requests), then SIGKILL to any still running after the drain."""
        self.stopping.set()
        for replica in self.replicas:
            if replica.process.poll() is None:
                replica.process.terminate()
        deadline = time.monotonic() + self.drain_timeout_s + STOP_GRACE_S
        for replica in self.replicas:
            try:
                replica.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("replica %d did not stop in time: killed", replica.index)
                replica.process.kill()
                replica.process.wait()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run_replicas(engine: EngineConfig, server: ServerConfig, replicas: int, policy: str) -> None:
    """Start the replicas, route to them on server.host:server.port until stopped, then stop them."""
    gpus = replica_gpus(engine.device, replicas)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # uvicorn's own handlers take over once it runs
    replica_set = ReplicaSet(server.drain_timeout_s)
    try:
        for index, gpu in enumerate(gpus):
            replica_set.replicas.append(start_replica(index, engine, server, gpu, replicas))
        wait_ready(replica_set.replicas)
        replica_set.watch()
        logger.info("%d replicas ready; routing (%s) on http://%s:%d", replicas, policy, server.host, server.port)
        run_router(RouterConfig(backends=tuple(r.url for r in replica_set.replicas), policy=policy,
                                host=server.host, port=server.port, max_body_bytes=server.max_body_bytes,
                                log_level=server.log_level))
    finally:
        replica_set.stop()
        signal.signal(signal.SIGTERM, previous)
