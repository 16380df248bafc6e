"""Start `goodserve serve` as a child process on a free loopback port, and read its /metrics."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2
from prometheus_client.parser import text_string_to_metric_families

from goodserve.ports import free_port


def scrape_metrics(url: str) -> dict[str, float]:
    """A server's /metrics as {'name{label=value,...}': value}, labels sorted, model_name left out."""
    samples = {}
    for family in text_string_to_metric_families(httpx2.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


@dataclass
class ServerProcess:
    process: subprocess.Popen
    url: str
    log_path: Path
    name: str = "goodserve serve"  # what its errors call it

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Signal the server and wait for it to exit; returns its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx2.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx2.TransportError:
                pass
            time.sleep(0.2)
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"{self.name} did not become healthy in {timeout_s}s:\n{self.log()[-4000:]}")

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(args: list[str], env: dict[str, str] | None = None) -> ServerProcess:
    """Start `goodserve serve ARGS --port <free>` without waiting for it (load something else meanwhile);
    env: variables set for the server alone, on top of this process's."""
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="goodserve-serve-", suffix=".log")[1])
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "goodserve.cli", "serve", "--port", str(port), *args],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env} if env else None,
        )
    return ServerProcess(process, f"http://127.0.0.1:{port}", log_path)


def launch_server(args: list[str], timeout_s: float = 180.0, env: dict[str, str] | None = None) -> ServerProcess:
    """Start the server and return once /health answers 200."""
    server = start_server(args, env)
    server.wait_ready(timeout_s)
    return server
