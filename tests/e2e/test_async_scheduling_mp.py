"""Async scheduling with the workers in processes of their own (executor_backend mp, tensor
parallelism on gloo): rank 0 holds the output of a step the engine runs ahead of until the next step
has launched, and the other ranks hold theirs alike. As in test_async_scheduling.py the runners get
eager stand-ins for their CUDA graphs, here inside each worker process (the executor spawns the
workers with this module's entry, which installs them and runs the executor's own). Each run is
compared with the synchronous engine on the same workers: same tokens, no block leaked; aborts in
flight free their blocks; a rank that dies mid-pipeline ends the engine."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time

import pytest

from goodserve import LLM, SamplingParams
from goodserve.engine.worker import cuda_graphs, executor, model_runner
from goodserve.errors import EngineDeadError
from helpers import shut_down, worker_processes
from test_async_scheduling import EagerDecodeGraph, abort_mid_pipeline, drive, summary
from test_tensor_parallel import SETTINGS
from test_tensor_parallel import fast_timeout  # noqa: F401 (a fixture its tests use)

PROMPTS = [list(range(3, 3 + n)) for n in (5, 9, 2, 14, 7)]


def _with_stand_in_graphs(target: str, poison: int | None, graphs: bool, *args) -> None:
    """A worker process's entry: the executor's own (target), its runner given stand-in graphs where
    `graphs` (and with poison, a forward that fails on any step computing that token, on every rank
    alike)."""
    build, forward = model_runner.ModelRunner.__init__, model_runner.ModelRunner.forward

    def poisoned_forward(runner, inputs):
        if bool((inputs.input_ids == poison).any()):
            raise RuntimeError("poisoned forward")
        return forward(runner, inputs)

    def build_with_graphs(runner, *build_args, **build_kwargs) -> None:
        build(runner, *build_args, **build_kwargs)
        sizes = (1, 2, 4, 8)
        runner.graphs.decode = cuda_graphs.GraphSet({size: EagerDecodeGraph(runner, size, None) for size in sizes},
                                                    dict.fromkeys(sizes, 1.0))

    if graphs:
        model_runner.ModelRunner.__init__ = build_with_graphs
    if poison is not None:
        model_runner.ModelRunner.forward = poisoned_forward
    getattr(executor, target)(*args)


@pytest.fixture
def workers_with_graphs(monkeypatch):
    """LLM(...) for the test's layout, its worker processes given stand-in graphs (graphs=False: none)
    and a poisoned forward (poison=token); shut down after."""
    made = []

    def make(model: str, poison: int | None = None, graphs: bool = True, **settings) -> LLM:
        for target in ("_leader_main", "_local_follower_main"):
            monkeypatch.setattr(executor, target, functools.partial(_with_stand_in_graphs, target, poison, graphs))
        made.append(LLM(model, **(SETTINGS | settings)))
        return made[-1]

    yield make
    for llm in made:
        shut_down(llm)


@contextlib.contextmanager
def async_scheduling(engine, on: bool):
    """The CPU resolves async scheduling off; the workers' stand-in graphs let it run."""
    saved = engine.config
    engine.config = dataclasses.replace(engine.config, async_scheduling=on)
    start = engine.steps.num_pipelined_steps
    try:
        yield lambda: engine.steps.num_pipelined_steps - start
    finally:
        engine.config = saved
        assert engine._inflight is None and not engine.has_unfinished()


def traffic(stop_token: int | None) -> dict[int, list]:
    """Mixed lengths, a stop token, and arrivals while others decode (each ends a pipeline)."""
    arrivals: dict[int, list] = {}
    for i, (prompt, max_tokens, at) in enumerate(zip(PROMPTS, (12, 5, 18, 9, 14), (0, 0, 0, 4, 9))):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                stop_token_ids=[stop_token] if stop_token is not None else [])
        arrivals.setdefault(at, []).append((f"r{i}", prompt, params))
    return arrivals


LAYOUTS = [("dummy:tiny", {"executor_backend": "mp"}), ("dummy:tiny", {"tensor_parallel_size": 2}),
           ("smollm2-135m", {"executor_backend": "mp"})]


@pytest.mark.parametrize("model, layout", LAYOUTS, ids=["mp", "tp2", "embedded-mp"])
def test_workers_in_processes_run_ahead_with_the_synchronous_engines_tokens(workers_with_graphs, model, layout):
    engine = workers_with_graphs(model, **layout).engine
    with async_scheduling(engine, on=False) as pipelined:
        first = summary(drive(engine, traffic(None)))
        assert pipelined() == 0
    stop_token = first["r0"][0][0][6]  # ends r0 early, and maybe others
    with async_scheduling(engine, on=False):
        reference = summary(drive(engine, traffic(stop_token)))
    assert reference["r0"][0][1] == "stop"
    steps_before = engine.steps.num_steps
    with async_scheduling(engine, on=True) as pipelined:
        assert summary(drive(engine, traffic(stop_token), check=True)) == reference
        # most decode steps ran ahead (the rest: prefills, the first step after each flush)
        assert pipelined() >= (engine.steps.num_steps - steps_before) // 2


@pytest.mark.parametrize("layout", [{"executor_backend": "mp"}, {"tensor_parallel_size": 2}], ids=["mp", "tp2"])
def test_aborts_while_a_held_step_is_in_flight_free_their_blocks(workers_with_graphs, layout):
    engine = workers_with_graphs("dummy:tiny", **layout).engine
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    arrivals = {0: [(f"a{i}", prompt, params) for i, prompt in enumerate(PROMPTS[:4])]}
    with async_scheduling(engine, on=False):
        reference = summary(drive(engine, arrivals))
    with async_scheduling(engine, on=True) as pipelined:
        aborted = abort_mid_pipeline(engine, arrivals[0])
        assert pipelined() > 0
    for rid, output in aborted.items():
        tokens, full = output.outputs[0].token_ids, reference[rid][0][0]
        assert output.outputs[0].finish_reason == "abort"
        assert 0 < len(tokens) < len(full) and tokens == full[: len(tokens)]
    # the ranks dropped the aborted sequences too: the same requests again give the same tokens
    with async_scheduling(engine, on=True):
        assert summary(drive(engine, arrivals)) == reference


@pytest.mark.parametrize("dead_rank", [0, 1])
def test_a_rank_that_dies_mid_pipeline_ends_the_engine(workers_with_graphs, dead_rank):
    """Rank 0 while it holds a step's output, or a rank it waits on."""
    engine = workers_with_graphs("dummy:tiny", tensor_parallel_size=2).engine
    engine.config = dataclasses.replace(engine.config, async_scheduling=True)
    engine.add_request("long", PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(20):
        if engine.steps.num_pipelined_steps >= 3:
            break
        engine.step()
    assert engine._inflight is not None  # rank 0 holds a step
    processes = worker_processes(engine)
    processes[dead_rank].kill()
    processes[dead_rank].join()
    t0 = time.perf_counter()
    with pytest.raises(EngineDeadError, match=f"rank {dead_rank} .* exited"):
        for _ in range(200):
            engine.step()
    assert time.perf_counter() - t0 < 60  # the liveness poll's seconds, not a collective's timeout


@pytest.mark.parametrize("layout", [{"executor_backend": "mp"}, {"tensor_parallel_size": 2}], ids=["mp", "tp2"])
def test_a_request_failing_a_step_launched_ahead_fails_alone(workers_with_graphs, layout, caplog):
    """The culprit is admitted into a step launched ahead while rank 0 holds the step before: that
    launch fails, the held step's tokens still come, and the next step (synchronous) isolates it."""
    poison = 2  # in no prompt here, nor in what the others generate (checked below)
    engine = workers_with_graphs("dummy:tiny", poison=poison, **layout).engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    innocents = [(f"r{i}", prompt, params) for i, prompt in enumerate(PROMPTS[:3])]
    with async_scheduling(engine, on=True):
        expected = summary(drive(engine, {0: innocents}))
    assert all(poison not in tokens for (tokens, *_), in expected.values())
    culprit = ("culprit", [5, poison, 6], params)
    with async_scheduling(engine, on=True) as pipelined:
        final = drive(engine, {0: innocents, 5: [culprit]}, check=True)
        assert pipelined() > 0
    assert "launching a step ahead failed" in caplog.text
    assert "poisoned forward" in final["culprit"].error
    assert {rid: v for rid, v in summary(final).items() if rid != "culprit"} == expected
