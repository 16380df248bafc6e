"""The engine in a process of its own (engine/frontend/engine_process.py), on dummy:tiny: the same tokens as
the engine on a thread of this process, a running output light and the finished one whole, a refused
request failing alone, an abandoned request's blocks freed, a killed engine process failing its
requests (and new ones) with EngineDeadError, start-up errors raised where it was asked for, and
`goodserve serve`'s engine process (its default) gone with a server killed by SIGKILL.
The HTTP side runs in test_server_openai.py, whose every case also runs with --engine-process."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from goodserve.cli import main
from goodserve.config import EngineConfig
from goodserve.engine.frontend.async_engine import AsyncEngine
from goodserve.engine.frontend.engine_process import EngineProcess
from goodserve.errors import EngineDeadError, InvalidRequestError, ModelLoadError
from goodserve.sampling_params import SamplingParams
from goodserve.server.process import launch_server

CONFIG = EngineConfig(model="dummy:tiny", num_kv_blocks=64)
PROMPTS = [[1, 2, 3, 4], [9, 8, 7], [5] * 20]


async def collect(engine, request_id: str, prompt: list[int], params: SamplingParams) -> list:
    return [out async for out in engine.generate(request_id, prompt, params)]


async def run_all(engine, params: SamplingParams) -> list[list]:
    await engine.start()
    return await asyncio.gather(*(collect(engine, f"r{i}", p, params) for i, p in enumerate(PROMPTS)))


@pytest.fixture(scope="module")
def process_engine():
    engine = EngineProcess(CONFIG)
    asyncio.run(engine.start())  # its pipe's threads, whichever test comes first
    yield engine
    asyncio.run(engine.shutdown(5.0))
    assert engine.process.exitcode == 0  # stopped when told, not killed


def wait_for_free_blocks(engine, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.stats().num_used_kv_blocks:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.05)


def test_the_same_tokens_as_the_engine_on_a_thread(process_engine):
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=7, n=2, ignore_eos=True, logprobs=2)
    there = asyncio.run(run_all(process_engine, params))
    here = asyncio.run(run_all(AsyncEngine(CONFIG), params))
    for outs_there, outs_here in zip(there, here):
        final_there, final_here = outs_there[-1], outs_here[-1]
        assert [c.token_ids for c in final_there.outputs] == [c.token_ids for c in final_here.outputs]
        for c_there, c_here in zip(final_there.outputs, final_here.outputs):  # batches may differ: float sums too
            for there_entry, here_entry in zip(c_there.logprobs, c_here.logprobs, strict=True):
                assert there_entry.keys() == here_entry.keys()
                assert [e.logprob for e in there_entry.values()] == \
                    pytest.approx([e.logprob for e in here_entry.values()], abs=1e-4)
        assert len(outs_there) == len(outs_here)  # one output a step there too


@pytest.mark.parametrize("workers", [{"executor_backend": "mp"}, {"tensor_parallel_size": 2}],
                         ids=["worker-process", "tensor-parallel-ranks"])
def test_workers_of_its_own_and_the_same_tokens(workers, monkeypatch):
    """Not a daemon process: it may start the worker process of --executor-backend mp, or TP's ranks."""
    monkeypatch.setenv("GOODSERVE_DISTRIBUTED_TIMEOUT_S", "20")  # a lost rank fails within seconds
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    engine = EngineProcess(replace(CONFIG, **workers))
    try:
        there = asyncio.run(run_all(engine, params))
    finally:
        asyncio.run(engine.shutdown(5.0))
    here = asyncio.run(run_all(AsyncEngine(CONFIG), params))
    assert [o[-1].outputs[0].token_ids for o in there] == [o[-1].outputs[0].token_ids for o in here]
    assert engine.process.exitcode == 0


def test_running_outputs_cross_light_and_the_finished_one_whole(process_engine):
    prompt = PROMPTS[0]
    outs = asyncio.run(collect(process_engine, "light", prompt, SamplingParams(max_tokens=6, ignore_eos=True,
                                                                               output_kind="delta")))
    *running, final = outs
    assert running and all(o.prompt_token_ids == [] and o.metrics.token_times == [] for o in running)
    assert all(o.metrics.first_token_time is not None for o in running)
    assert final.finished and final.prompt_token_ids == prompt
    assert len(final.metrics.token_times) == 6
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 6  # deltas: each token once


def test_the_servers_metrics_carry_the_engine_process_collections(process_engine):
    from prometheus_client.parser import text_string_to_metric_families

    from goodserve.server.metrics import ServerMetrics, Slo

    asyncio.run(run_all(process_engine, SamplingParams(max_tokens=3)))  # a message since start: its pauses
    text = ServerMetrics(process_engine, "m", Slo()).render().decode()
    family = next(f for f in text_string_to_metric_families(text) if f.name == "goodserve:gc_pause_seconds")
    counts = {(s.labels["process"], s.labels["generation"]) for s in family.samples if s.name.endswith("_count")}
    assert counts == {(process, str(g)) for process in ("server", "engine") for g in range(3)}


def test_a_refused_request_fails_alone(process_engine):
    async def one_bad_among_good() -> list:
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        bad = [1, 2, 10**6]  # past the vocabulary: the engine refuses it when it comes (nothing validated it here)
        return await asyncio.gather(*(collect(process_engine, f"mixed{i}", p, params)
                                      for i, p in enumerate([PROMPTS[0], bad, PROMPTS[1]])), return_exceptions=True)

    good, bad, also_good = asyncio.run(one_bad_among_good())
    assert isinstance(bad, InvalidRequestError) and "prompt token ids must be in" in str(bad)
    assert good[-1].finished and also_good[-1].finished
    wait_for_free_blocks(process_engine)


def test_a_request_id_in_use_is_refused_at_once(process_engine):
    async def twice() -> None:
        process_engine.add("twice", PROMPTS[0], SamplingParams(max_tokens=2), lambda item: None)
        try:
            with pytest.raises(InvalidRequestError, match="already in use"):
                process_engine.add("twice", PROMPTS[1], SamplingParams(max_tokens=2), lambda item: None)
        finally:
            process_engine.release("twice")

    asyncio.run(twice())
    wait_for_free_blocks(process_engine)


def test_an_abandoned_request_is_aborted_and_frees_its_blocks(process_engine):
    async def read_two_and_leave() -> None:
        stream = process_engine.generate("left", PROMPTS[2], SamplingParams(max_tokens=500, ignore_eos=True))
        for _ in range(2):
            await anext(stream)
        await stream.aclose()  # release(): the engine aborts it

    asyncio.run(read_two_and_leave())
    assert "left" not in process_engine.streams
    wait_for_free_blocks(process_engine)
    assert process_engine.stats().num_running == 0


async def fail_mid_request(engine: EngineProcess, breaking) -> BaseException:
    """The EngineDeadError a running request's stream raises once breaking() has run."""
    await engine.start()
    stream = engine.generate("doomed", PROMPTS[0], SamplingParams(max_tokens=1000, ignore_eos=True))
    await anext(stream)
    breaking()
    with pytest.raises(EngineDeadError) as raised:
        async for _ in stream:
            pass
    return raised.value


def test_a_killed_engine_process_fails_its_requests_and_refuses_new_ones(caplog):
    engine = EngineProcess(CONFIG)
    with caplog.at_level(logging.ERROR, logger="goodserve.engine"):
        error = asyncio.run(fail_mid_request(engine, engine.process.kill))
    assert "exited with" in str(error)
    # said in the log when it happens, not first by the next request's 503
    assert any(f"pid {engine.process.pid}" in r.getMessage() and "restart" in r.getMessage() for r in caplog.records)
    assert engine.dead is not None
    with pytest.raises(EngineDeadError):
        engine.add("late", PROMPTS[1], SamplingParams(max_tokens=2), lambda item: None)


def test_an_engine_loop_that_dies_says_why_to_every_caller():
    engine = EngineProcess(CONFIG)
    # a bug on the engine's side: apply_command fails on it
    error = asyncio.run(fail_mid_request(engine, lambda: engine._outbox.put("not a command")))
    assert "the engine stopped" in str(error) and "request_id" in str(error)
    engine.process.join(120)
    assert engine.process.exitcode == 0  # it reported, aborted what it had and ended


def test_start_up_errors_are_raised_where_the_engine_was_asked_for(tmp_path):
    with pytest.raises(ModelLoadError):
        EngineProcess(EngineConfig(model=str(tmp_path / "no-such-model")))


def test_serve_refuses_engine_process_with_disaggregation(capsys):
    assert main(["serve", "--model", "dummy:tiny", "--engine-process", "--disaggregate", "prefill:0,decode:1"]) == 2
    assert "drop --engine-process" in capsys.readouterr().err


def children_of(pid: int) -> set[int]:
    return {int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()}


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_serve_steps_on_a_thread_with_no_engine_process():
    server = launch_server(["--model", "dummy:tiny", "--no-engine-process", "--num-kv-blocks", "64"])
    try:
        assert children_of(server.process.pid) == set()
    finally:
        server.stop()


def test_the_engine_process_by_default_exits_when_the_server_is_killed():
    server = launch_server(["--model", "dummy:tiny", "--num-kv-blocks", "64"])
    try:
        engine_side = children_of(server.process.pid)
        assert engine_side
    finally:
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
    deadline = time.monotonic() + 60
    while any(map(running, engine_side)):  # a SIGKILL runs no cleanup: the pipe's end is what it sees
        assert time.monotonic() < deadline, "the engine process outlived its server"
        time.sleep(0.1)


def test_a_program_that_exits_without_shutdown_does_not_hang():
    """The engine process is not a daemon, so multiprocessing joins it at exit: the pipe closed first
    must stop it."""
    script = ("import asyncio; from goodserve.config import EngineConfig; "
              "from goodserve.engine.frontend.engine_process import EngineProcess; "
              "from goodserve.sampling_params import SamplingParams; "
              "e = EngineProcess(EngineConfig(model='dummy:tiny', num_kv_blocks=64)); "
              "asyncio.run(e.start()); print(e.process.pid)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert not running(int(done.stdout.split()[-1]))


def test_bench_drives_an_engine_process(tmp_path):
    from goodserve.bench import command
    from test_bench_client import bench_args

    out = tmp_path / "r.json"
    args = bench_args("--backend", "inprocess", "--engine-process", "--model", "dummy:tiny", "--device", "cpu",
                      "--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "3", "--ignore-eos",
                      "--result-filename", str(out))
    assert command.run_command(args) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 4 and result["total_output_tokens"] == 12
    assert result["engine_config"]["engine_process"] == "True"


def test_a_stopped_engine_process_is_not_kept_alive_by_its_exit_hook():
    """The exit hook that closes the pipe at interpreter exit goes with a shutdown: a server that
    starts and stops engines (a test run, tune's trials) does not keep every stopped one for good."""
    import gc
    import weakref

    engine = EngineProcess(CONFIG)
    asyncio.run(engine.start())
    asyncio.run(engine.shutdown(5.0))
    gone = weakref.ref(engine)
    del engine
    gc.collect()
    assert gone() is None
