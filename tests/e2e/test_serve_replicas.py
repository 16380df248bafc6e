"""`goodserve serve --data-parallel-size 2 --model dummy:tiny`: two engine servers and the router under
one command, driven by the official openai client: both replicas serve, a replica killed mid-run
loses no request (none of them had begun answering: a non-streamed answer comes whole), its death is
reported, and Ctrl-C stops every process. One stack for the module; the tests run in order."""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from goodserve.config import EngineConfig
from goodserve.engine_args import dataclass_argv, dataclass_from_args
from goodserve.server import command as serve_command
from goodserve.server.app import ServerConfig
from goodserve.server.process import ServerProcess, free_port, scrape_metrics
from helpers import HTTP_TIMEOUT_S

MODEL = "dummy:tiny"
MAX_TOKENS = 512  # a killed-replica test's requests (see there)
REPLICA_LINE = re.compile(r"replica (\d): pid (\d+) at (http://\S+)")


def parse_serve(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_command.register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_a_replica_is_started_with_the_flags_the_launcher_was_given():
    args = parse_serve("--model", MODEL, "--max-num-seqs", "7", "--no-enable-prefix-caching",
                       "--gpu-memory-utilization", "0.5", "--slo-ttft-ms", "250", "--data-parallel-size", "2")
    engine, server = dataclass_from_args(EngineConfig, args), dataclass_from_args(ServerConfig, args)
    again = parse_serve(*dataclass_argv(engine), *dataclass_argv(server))
    assert dataclass_from_args(EngineConfig, again) == engine
    assert dataclass_from_args(ServerConfig, again) == server
    assert again.data_parallel_size == 1  # the replica serves; it does not launch replicas of its own


def start_launcher(*flags: str, model: str = MODEL) -> ServerProcess:
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="goodserve-dp-", suffix=".log")[1])
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "goodserve.cli", "serve", "--port", str(port), "--model", model, *flags],
            stdout=log, stderr=subprocess.STDOUT)
    return ServerProcess(process, f"http://127.0.0.1:{port}", log_path)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    launcher = start_launcher("--data-parallel-size", "2", "--router-policy", "round-robin",
                              "--data-dir", str(tmp_path_factory.mktemp("dp")))
    try:
        launcher.wait_ready(300)
        replicas = {int(i): (int(pid), url) for i, pid, url in REPLICA_LINE.findall(launcher.log())}
        assert sorted(replicas) == [0, 1]
        client = openai.OpenAI(base_url=f"{launcher.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)
        yield launcher, replicas, client
    finally:
        launcher.stop(signal.SIGKILL)  # its replicas follow it (parent-death signal)


def served(url: str) -> float:
    return sum(v for k, v in scrape_metrics(url).items() if k.startswith("goodserve:request_success_total"))


def test_requests_are_answered_by_both_replicas(stack):
    launcher, replicas, client = stack
    answers = [client.completions.create(model=MODEL, prompt=[11, 12, 13 + i], max_tokens=4, temperature=0)
               for i in range(4)]
    assert all(a.usage.completion_tokens == 4 for a in answers)
    assert [served(url) for _, url in replicas.values()] == [2, 2]


def test_a_replica_killed_mid_run_loses_no_request(stack):
    launcher, replicas, client = stack
    pid, url = replicas[0]

    # Long enough that replica 0 is still answering when a scrape sees it busy, even on a loaded
    # machine (with 64 tokens the requests could all finish between two scrapes, and the wait below
    # had no end).
    def ask(i: int):
        return client.completions.create(model=MODEL, prompt=[20 + i, 21, 22], max_tokens=MAX_TOKENS,
                                         extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(8) as pool:
        pending = [pool.submit(ask, i) for i in range(16)]
        deadline = time.monotonic() + 60
        while not scrape_metrics(url).get("goodserve:num_requests_running{}"):
            assert time.monotonic() < deadline and not all(f.done() for f in pending), "replica 0 never seen busy"
            time.sleep(0.01)
        subprocess.run(["kill", "-KILL", str(pid)], check=True)  # with requests running on it
        answers = [future.result() for future in pending]
    assert all(a.usage.completion_tokens == MAX_TOKENS for a in answers)
    deadline = time.monotonic() + 60
    while "replica 0 (pid" not in launcher.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert f"replica 0 (pid {pid}, {url}) exited with -9" in launcher.log()
    assert scrape_metrics(launcher.url)["goodserve:router_retries_total{}"] >= 1
    # Out of rotation at once if a request found its port closed, else by the next health check
    # (router health_interval_s, 2 s): a request cut mid-answer does not say the replica is gone.
    healthy = f"goodserve:router_backend_healthy{{backend={url}}}"
    deadline = time.monotonic() + 60
    while scrape_metrics(launcher.url)[healthy] != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert scrape_metrics(launcher.url)[healthy] == 0
    assert launcher.process.poll() is None
    assert client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == 2


def test_ctrl_c_stops_the_router_and_every_replica(stack):
    launcher, replicas, _ = stack
    survivor = replicas[1][0]
    assert alive(survivor)
    launcher.process.send_signal(signal.SIGINT)
    launcher.process.wait(120)
    deadline = time.monotonic() + 60
    while alive(survivor) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(survivor)


def test_a_replica_that_fails_to_start_fails_the_launch(tmp_path):
    """A checkpoint whose weights file is not safetensors: the flags and config.json pass the launcher's
    own checks (an unknown model would be refused before any replica starts), its replicas fail to load."""
    from test_loaders import TINY_CONFIGS, save_tiny_hf_model

    model = tmp_path / "model"
    save_tiny_hf_model(TINY_CONFIGS["llama-gqa-untied"](), model)
    for weights in model.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    launcher = start_launcher("--data-parallel-size", "2", "--data-dir", str(tmp_path / "data"), model=str(model))
    try:
        assert launcher.process.wait(120) == 2
    finally:
        launcher.stop(signal.SIGKILL)
    log = launcher.log()
    assert re.search(r"replica \d exited with \d+ while starting", log), log[-2000:]
    for pid in (int(p) for _, p, _ in REPLICA_LINE.findall(log)):
        assert not alive(pid)
