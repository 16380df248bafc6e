"""The processes goodserve starts for itself stop when their parent says so (engine/processes/stop_signals.py):
a SIGTERM or SIGINT sent to every process of a service at once (a service manager's stop, a
terminal's Ctrl-C) leaves a tensor-parallel server's ranks stepping while the server drains; an
orphan still obeys SIGTERM; and a program that exits without shutting its workers down still exits."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2

from goodserve.server.process import launch_server
from test_engine_process import running

CHILD = ("import time; from goodserve.engine.processes.stop_signals import leave_stopping_to_the_parent; "
         "leave_stopping_to_the_parent(); print('ready', flush=True); time.sleep(120)")


def descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in map(int, (task / "children").read_text().split()):
            found += [child, *descendants(child)]
    return found


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_child_ignores_sigterm_and_sigint_while_its_parent_lives():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGTERM)
        child.send_signal(signal.SIGINT)
        assert not wait_gone(child.pid, 1.0)
    finally:
        child.kill()
        child.wait()


def test_an_orphan_obeys_sigterm():
    parent = ("import subprocess, sys; child = subprocess.Popen([sys.executable, '-c', sys.argv[1]], stderr=subprocess.DEVNULL, "
              "stdout=subprocess.PIPE, text=True); child.stdout.readline(); print(child.pid)")
    done = subprocess.run([sys.executable, "-c", parent, CHILD], capture_output=True, text=True, timeout=300)
    orphan = int(done.stdout.split()[-1])
    assert running(orphan)
    subprocess.run(["kill", "-TERM", str(orphan)], check=True)
    assert wait_gone(orphan, 10.0)


def test_a_program_that_exits_without_shutting_its_worker_down_exits():
    """multiprocessing SIGTERMs a daemonic child at exit and waits for it: a worker that ignores the
    signal is killed first (kill_at_exit), or the program would wait for ever."""
    script = ("from goodserve.config import EngineConfig; from goodserve.engine.frontend.engine import Engine; "
              "e = Engine(EngineConfig(model='dummy:tiny', num_kv_blocks=64, executor_backend='mp')); "
              "print(e.executor._processes[0].pid)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert wait_gone(int(done.stdout.split()[-1]), 5.0)


def test_a_tensor_parallel_server_drains_when_every_process_gets_sigterm():
    """systemd stops a service by SIGTERM to every process of its control group: the server, its
    engine process and the two ranks. The request in flight still finishes; then all of them exit."""
    server = launch_server(["--model", "dummy:tiny", "--num-kv-blocks", "256", "--tensor-parallel-size", "2"],
                           env={"GOODSERVE_DISTRIBUTED_TIMEOUT_S": "20"})
    body = {"model": "dummy:tiny", "prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "stream": True}
    lines: list[str] = []
    first_chunk = threading.Event()

    def consume() -> None:
        with httpx2.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    first_chunk.set()

    reader = threading.Thread(target=consume)
    try:
        processes = [server.process.pid, *descendants(server.process.pid)]
        assert len(processes) >= 4  # the server, its engine process, two ranks (and resource trackers)
        reader.start()
        assert first_chunk.wait(120)
        for pid in processes:
            signal_if_running(pid, signal.SIGTERM)
        reader.join(120)
        assert server.process.wait(120) == -signal.SIGTERM
    finally:
        server.stop(signal.SIGKILL)
    assert lines[-1] == "data: [DONE]", server.log()[-3000:]
    assert '"finish_reason":"length"' in lines[-2]
    assert all(wait_gone(pid, 20.0) for pid in processes)


def signal_if_running(pid: int, sig: int) -> None:
    if running(pid):
        subprocess.run(["kill", f"-{sig.name[3:]}", str(pid)], check=False)
