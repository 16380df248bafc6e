"""The server's /metrics names the engine's resolved configuration (goodserve:engine_config_info),
which bench records and diagnose reads."""

import pytest
import torch

from goodserve.bench.engine_config import fetch_engine_config, parse_engine_config
from goodserve.config import EngineConfig
from goodserve.cpu_threads import available_cores
from goodserve.server.metrics import ServerMetrics, Slo


@pytest.fixture(scope="module")
def int8_kv_engine():
    from goodserve.engine.frontend.async_engine import AsyncEngine

    return AsyncEngine(EngineConfig(model="dummy:tiny", num_kv_blocks=64, kv_cache_dtype="int8",
                                    enable_prefix_caching=False, max_num_seqs=8))


def test_info_metric_names_the_resolved_cpu_engine(int8_kv_engine):
    info = parse_engine_config(ServerMetrics(int8_kv_engine, "served", Slo()).render().decode())
    assert info == {
        "model": "dummy:tiny", "dtype": "float32",  # auto on a CPU
        "quantization": "none", "kv_cache_dtype": "int8", "device": "cpu", "device_name": "cpu",
        "attention_backend": "torch", "scheduler_policy": "continuous", "enable_chunked_prefill": "True",
        "enable_prefix_caching": "False", "cuda_graphs": "False", "async_scheduling": "False",  # no graphs on a CPU
        "engine_process": "False",  # AsyncEngine: a thread of this process
        "pipeline_micro_batches": "False",  # one stage
        "max_num_seqs": "8",
        "max_num_batched_tokens": "2048", "speculative_method": "none",
        "speculative_model": "none",
        # the cores this process may use and the engine's torch threads; no pool of the server's own
        "cpu_cores": str(available_cores().count), "cpu_threads": str(torch.get_num_threads()),
        "server_cpu_threads": "0", "world_size": "1"}


def test_other_servers_have_no_engine_config():
    assert parse_engine_config("# HELP vllm:num_requests_running x\nvllm:num_requests_running 0.0\n") is None
    assert fetch_engine_config("http://127.0.0.1:9/metrics", timeout_s=1) is None  # nothing listens


def test_serve_logs_the_quantization_and_kv_dtype(monkeypatch, caplog):
    import goodserve.server.app as app
    from goodserve.cli import main

    monkeypatch.setattr(app, "run_server", lambda engine, config: None)  # the log line, not the server
    with caplog.at_level("INFO", logger="goodserve.server"):
        assert main(["serve", "--model", "dummy:tiny", "--num-kv-blocks", "64", "--kv-cache-dtype", "int8",
                     "--quantization", "int8"]) == 0
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("engine: "))
    assert "quantization=int8 " in line and "kv_cache_dtype=int8 " in line and "dtype=float32 " in line
