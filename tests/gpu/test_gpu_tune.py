"""goodserve tune on CUDA: the quality gate's baseline and a candidate each load an engine that takes
its gpu_memory_utilization share of the card, one after the other (a baseline loaded beside the
candidate found no room for its KV cache)."""

from __future__ import annotations

from goodserve.commands.quality_gate import EXACT_THRESHOLDS
from goodserve.config import EngineConfig
from goodserve.model_names import EMBEDDED_MODEL
from goodserve.tune.measure import QualityGate, quality_settings


def test_a_candidates_quality_is_gated_against_the_baseline_on_cuda(device, cuda_only):
    start = EngineConfig(model=EMBEDDED_MODEL, device=device, dtype="float32")
    gate = QualityGate(start, quality_settings(["Name three primary colours."], None, 128, 8, 64), {})
    quality = gate.check_apart(start)  # Triton attention and CUDA graphs against torch attention, eager
    assert quality["checked"] and quality["passed"], quality["summary"]


def test_the_default_16_bit_configuration_passes_the_gate_of_exact_changes(device, cuda_only):
    """The default on CUDA (bf16, Triton attention, graphs) against its unoptimized baseline (bf16, torch
    attention, eager) at tune's quality settings: rounding noise only, within the bf16 floor. Against
    float32's floor it failed (top-1 agreement 0.974, greedy agreement 0.71), so tune stopped at its
    first trial on the embedded model."""
    start = EngineConfig(model=EMBEDDED_MODEL, device=device)
    gate = QualityGate(start, quality_settings([], None, 2048, 32, 256), {})
    quality = gate.check_apart(start)
    assert quality["checked"] and quality["passed"], quality["summary"]
    assert quality["checks"][1]["limit"] == EXACT_THRESHOLDS["bfloat16"][1]  # the engine ran bf16
