"""The shipped Grafana dashboard and Prometheus alert rules query only metrics the server exports,
and so do vLLM's example dashboard's queries with its prefix swapped: read from a real /metrics
(the app in-process on dummy:tiny, one request served), parsed by prometheus_client. Without an
SLO target no attainment series is counted."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx2
import yaml
from prometheus_client.parser import text_string_to_metric_families

from goodserve.config import EngineConfig
from goodserve.engine.frontend.async_engine import AsyncEngine
from goodserve.server.app import ServerConfig, build_app

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
METRIC = re.compile(r"\b(goodserve:[a-zA-Z0-9_:]+|process_[a-z_]+)")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",),
            "gauge": ("",), "summary": ("_sum", "_count")}
# What vLLM's example dashboard (examples/online_serving/prometheus_grafana/grafana.json) queries, and
# the names its newer dashboards and the vLLM documentation's metrics list add.
VLLM_DASHBOARD = ["e2e_request_latency_seconds_bucket", "e2e_request_latency_seconds_sum", "prompt_tokens_total",
                  "generation_tokens_total", "time_per_output_token_seconds_bucket", "num_requests_running",
                  "num_requests_waiting", "time_to_first_token_seconds_bucket", "gpu_cache_usage_perc",
                  "kv_cache_usage_perc", "request_prompt_tokens_bucket", "request_generation_tokens_bucket",
                  "request_success_total", "request_queue_time_seconds_sum", "request_prefill_time_seconds_sum",
                  "request_decode_time_seconds_sum", "request_max_num_generation_tokens_sum",
                  "iteration_tokens_total_bucket", "cache_config_info", "request_params_n_bucket",
                  "prefix_cache_hits_total", "prefix_cache_queries_total", "num_preemptions_total",
                  "inter_token_latency_seconds_bucket", "request_inference_time_seconds_sum"]


async def _scrape(tmp_path, **server) -> str:
    engine = AsyncEngine(EngineConfig(model="dummy:tiny", num_kv_blocks=32, max_model_len=128))
    app = build_app(engine, ServerConfig(data_dir=str(tmp_path), **server))
    async with app.router.lifespan_context(app):
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://app") as http:
            answer = await http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True})
            assert answer.status_code == 200, answer.text
            return (await http.get("/metrics")).text


def exported(text: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {sample.name for sample in family.samples}
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    return names


def queried(exprs: list[str]) -> set[str]:
    return {name for expr in exprs for name in METRIC.findall(expr)}


def test_every_dashboard_and_alert_query_names_an_exported_metric(tmp_path):
    names = exported(asyncio.run(_scrape(tmp_path, slo_ttft_ms=60_000, gpu_hourly_cost=2.0)))
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    panel_exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    rules = yaml.safe_load((MONITORING / "prometheus-alerts.yml").read_text())
    rule_exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    assert len(queried(panel_exprs)) >= 20 and len(rule_exprs) >= 6
    assert queried(panel_exprs + rule_exprs) - names == set()
    assert {"goodserve:cost_per_hour_dollars", "process_cpu_seconds_total"} <= names
    assert {f"goodserve:{name}" for name in VLLM_DASHBOARD} - names == set()


def test_without_slo_targets_no_request_counts_as_attained(tmp_path):
    families = {f.name: f for f in text_string_to_metric_families(asyncio.run(_scrape(tmp_path)))}
    assert families["goodserve:request_slo"].samples == []  # declared, never counted
    served = {tuple(s.labels.items()): s.value for s in families["goodserve:request_success"].samples
              if s.name.endswith("_total")}
    assert sum(served.values()) == 1  # the request itself was served and counted
    assert "goodserve:cost_per_hour_dollars" not in families  # no --gpu-hourly-cost, no cost series


def test_iteration_tokens_and_request_params_n_count_what_was_run(tmp_path):
    samples = {(s.name, s.labels.get("le")): s.value for f in text_string_to_metric_families(
        asyncio.run(_scrape(tmp_path))) for s in f.samples}
    # One prompt of 3 tokens, then 3 decode steps of 1 token (the 4th token comes with the last step).
    steps = samples[("goodserve:iteration_tokens_total_count", None)]
    assert samples[("goodserve:iteration_tokens_total_sum", None)] == 3 + (steps - 1)
    assert samples[("goodserve:iteration_tokens_total_bucket", "1")] == steps - 1
    assert samples[("goodserve:request_params_n_count", None)] == 1
    assert samples[("goodserve:request_params_n_bucket", "1.0")] == 1
