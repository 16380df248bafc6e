"""goodserve tune on CUDA: the quality gate's baseline and a candidate each load an engine that takes
its gpu_memory_utilization share of the card, one after the other (a baseline loaded beside the
candidate found no room for its KV cache)."""

from __future__ import annotations

from goodserve.config import EngineConfig
from goodserve.model_names import EMBEDDED_MODEL
from goodserve.tune.measure import QualityGate, quality_settings


def test_a_candidates_quality_is_gated_against_the_baseline_on_cuda(device, cuda_only):
    start = EngineConfig(model=EMBEDDED_MODEL, device=device, dtype="float32")
    gate = QualityGate(start, quality_settings(["Name three primary colours."], None, 128, 8, 64), {})
    quality = gate.check_apart(start)  # Triton attention and CUDA graphs against torch attention, eager
    assert quality["checked"] and quality["passed"], quality["summary"]
