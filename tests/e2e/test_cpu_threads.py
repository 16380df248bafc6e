"""The thread count per process from the cores really usable (affinity, a cgroup quota) and the
processes goodserve runs; the serve log says it; diagnose flags an engine with more compute threads
than cores."""

from __future__ import annotations

import logging

import pytest

from goodserve.cli import main
from goodserve.cpu_threads import Cores, available_cores, cgroup_quota, plan_threads
from goodserve.diagnose.advisor import advise
from goodserve.diagnose.parallel import analyze_replica
from goodserve.engine.frontend import engine_process
from test_diagnose import GPU, SPEC, obs


def test_a_cgroup_quota_is_read_in_cores(tmp_path):
    v2 = tmp_path / "cpu.max"
    v2.write_text("150000 100000\n")
    assert cgroup_quota(v2, (tmp_path / "none", tmp_path / "none")) == 1.5
    v2.write_text("max 100000\n")
    assert cgroup_quota(v2, (tmp_path / "none", tmp_path / "none")) is None
    quota, period = tmp_path / "quota", tmp_path / "period"
    quota.write_text("200000")
    period.write_text("100000")
    assert cgroup_quota(tmp_path / "absent", (quota, period)) == 2.0


def test_available_cores_never_exceed_the_affinity():
    import os

    cores = available_cores()
    assert 1 <= cores.count <= len(os.sched_getaffinity(0)) == cores.affinity


@pytest.mark.parametrize("cores, engine_process, world, expected", [
    (2, True, 1, (1, 1)),  # the shared 2-core machine: one for the engine, the server's loop keeps one
    (16, True, 1, (15, 1)),
    (16, True, 4, (3, 1)),  # tensor-parallel ranks share the cores
    (8, False, 1, (7, 7)),  # the engine steps in the server's process: one pool
    (1, True, 2, (1, 1)),
])
def test_the_plan_splits_the_usable_cores(cores, engine_process, world, expected):
    plan = plan_threads(engine_process, world, Cores(cores, cores, None), environ={})
    assert (plan.engine, plan.server) == expected
    assert plan.engine * world + (plan.server if engine_process else 0) <= max(cores, world + 1)


def test_omp_num_threads_as_set_wins():
    plan = plan_threads(True, 1, Cores(16, 16, None), environ={"OMP_NUM_THREADS": "3"})
    assert (plan.engine, plan.server, plan.source) == (3, 1, "OMP_NUM_THREADS as set")


def test_serve_logs_its_thread_plan(monkeypatch, caplog):
    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop  # the plan is applied and logged before the engine starts

    import torch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # (restored after, as serve sets it for the engine)
    monkeypatch.setattr(engine_process.EngineProcess, "__init__", stop)
    threads = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="goodserve.server"), pytest.raises(Stop):
            main(["serve", "--model", "dummy:tiny", "--log-level", "info"])
    finally:
        torch.set_num_threads(threads)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU threads:")]
    cores = available_cores().count
    assert f"{max(1, cores - 1)} per engine rank, 1 for the server's process; {cores} cores usable" in line


def test_diagnose_flags_more_threads_than_cores():
    engine = {"device": "cpu", "cpu_cores": "2", "cpu_threads": "2", "server_cpu_threads": "2", "world_size": "1"}
    o = obs()
    (found,) = [a for a in advise(o, analyze_replica(SPEC, GPU, o), engine) if a.symptom == "CPU oversubscribed"]
    assert "4 compute threads" in found.evidence and found.fixes[0].option.startswith("OMP_NUM_THREADS=1")
    fitting = {**engine, "cpu_threads": "1", "server_cpu_threads": "1"}
    assert "CPU oversubscribed" not in [a.symptom for a in advise(o, analyze_replica(SPEC, GPU, o), fitting)]
