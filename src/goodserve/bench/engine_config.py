"""The server's engine configuration, read from goodserve's `engine_config_info` metric.

bench records it in the result JSON and diagnose reads it from there (or from a live /metrics), so
neither has to guess the model, dtype, quantization, KV dtype or hardware a run used.
"""

from __future__ import annotations

import httpx2
from prometheus_client.parser import text_string_to_metric_families

INFO_SAMPLE = "goodserve:engine_config_info"


def parse_engine_config(metrics_text: str) -> dict[str, str] | None:
    """The info metric's labels (model_name dropped), or None when the text has none (not goodserve)."""
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == INFO_SAMPLE:
                return {k: v for k, v in sample.labels.items() if k != "model_name"}
    return None


def fetch_metrics_text(metrics_url: str, api_key: str | None = None, timeout_s: float = 5.0) -> str | None:
    """The /metrics text, or None when the URL cannot be read (a hosted API has none)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx2.get(metrics_url, headers=headers, timeout=timeout_s)
        response.raise_for_status()
        return response.text
    except httpx2.HTTPError:
        return None


def fetch_engine_config(metrics_url: str, api_key: str | None = None,
                        timeout_s: float = 5.0) -> dict[str, str] | None:
    """None when the URL cannot be read or is not a goodserve server's /metrics (vLLM, a hosted API)."""
    text = fetch_metrics_text(metrics_url, api_key, timeout_s)
    try:
        return None if text is None else parse_engine_config(text)
    except ValueError:  # not Prometheus text
        return None


def describe(config: dict[str, str]) -> str:
    """One line for a terminal: the settings a newcomer checks first."""
    keys = ("model", "dtype", "quantization", "kv_cache_dtype", "device_name", "attention_backend",
            "cuda_graphs", "scheduler_policy")
    return ", ".join(f"{k}={config[k]}" for k in keys if k in config)
