"""A serving engine keeps the objects alive at its start out of the collector's full passes
(engine/processes/gc_pauses.py): on a 2-core CPU at 256-448 streams those passes took 122-166 ms, after 3-9
(benchmarks/results/cpu_host_step_gc_freeze_intel.json)."""

import asyncio
import gc

import pytest

from goodserve.config import EngineConfig
from goodserve.engine.frontend.async_engine import AsyncEngine
from goodserve.sampling_params import SamplingParams


def test_a_started_engine_freezes_the_startup_heap_and_gives_it_back_at_shutdown():
    gc.unfreeze()  # whatever an earlier test's engine left frozen

    async def serve_one_request():
        engine = AsyncEngine(EngineConfig(model="dummy:tiny", device="cpu", num_kv_blocks=16))
        built = len(gc.get_objects())
        await engine.start()
        frozen, walked = gc.get_freeze_count(), len(gc.get_objects())
        outputs = [out async for out in engine.generate("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))]
        await engine.shutdown()
        return built, frozen, walked, outputs

    built, frozen, walked, outputs = asyncio.run(serve_one_request())
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 2
    # The engine, the model and every imported module: frozen, so a full pass walks a fraction.
    assert frozen > 0.9 * built and walked < 0.1 * built
    assert gc.get_freeze_count() == 0


def test_the_servers_metrics_count_every_full_collection_and_its_time():
    from prometheus_client.parser import text_string_to_metric_families

    from goodserve.server.metrics import ServerMetrics, Slo

    def full_collections(metrics: ServerMetrics) -> tuple[float, float]:
        text = metrics.render().decode()
        family = next(f for f in text_string_to_metric_families(text) if f.name == "goodserve:gc_pause_seconds")
        full = {s.name.removeprefix("goodserve:gc_pause_seconds"): s.value for s in family.samples
                if s.labels["generation"] == "2" and "le" not in s.labels}
        return full["_count"], full["_sum"]

    metrics = ServerMetrics(AsyncEngine(EngineConfig(model="dummy:tiny", device="cpu", num_kv_blocks=16)), "m", Slo())
    count, seconds = full_collections(metrics)
    for _ in range(3):
        gc.collect()
    after, more_seconds = full_collections(metrics)
    assert after == count + 3 and more_seconds > seconds


def test_serving_tunes_the_collector_and_switch_interval_from_the_environment(monkeypatch):
    import sys

    from goodserve.engine.processes.gc_pauses import SERVING_GC_GEN0_THRESHOLD, tune_for_serving

    threshold, interval = gc.get_threshold(), sys.getswitchinterval()
    try:
        monkeypatch.delenv("GOODSERVE_GC_THRESHOLD", raising=False)
        monkeypatch.delenv("GOODSERVE_SWITCH_INTERVAL_MS", raising=False)
        tune_for_serving()  # nothing set: the serving defaults
        assert gc.get_threshold()[0] == SERVING_GC_GEN0_THRESHOLD and sys.getswitchinterval() == 0.0005
        monkeypatch.setenv("GOODSERVE_GC_THRESHOLD", "20000,20")
        monkeypatch.setenv("GOODSERVE_SWITCH_INTERVAL_MS", "0.5")
        tune_for_serving()
        assert gc.get_threshold() == (20000, 20, threshold[2]) and sys.getswitchinterval() == 0.0005
    finally:
        gc.set_threshold(*threshold)
        sys.setswitchinterval(interval)


@pytest.mark.parametrize("variable, value", [("GOODSERVE_GC_THRESHOLD", "lots"), ("GOODSERVE_GC_THRESHOLD", "1,2,3,4"),
                                             ("GOODSERVE_GC_THRESHOLD", "-5"), ("GOODSERVE_SWITCH_INTERVAL_MS", "0"),
                                             ("GOODSERVE_SWITCH_INTERVAL_MS", "fast")])
def test_serve_refuses_a_bad_setting_before_loading_anything(monkeypatch, capsys, variable, value):
    from goodserve.cli import main

    monkeypatch.setenv(variable, value)
    assert main(["serve", "--model", "dummy:tiny"]) != 0
    assert f"{variable}={value!r}" in capsys.readouterr().err
