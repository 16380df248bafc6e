"""Rope scaling's parameters (Llama-3's, linear, Phi-3's LongRoPE), apart from the rotary op (rotary.py): a
model's shape (model/spec.py) carries them, and shapes are read without torch (the calculators, the bench)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LinearRope:
    """Linear position interpolation (rope_type "linear"): every frequency divided by `factor`."""

    factor: float


@dataclass(frozen=True)
class LongRope:
    """Phi-3's LongRoPE (rope_type "longrope", formerly "su"): each frequency divided by its own
    factor, `short_factor` within the original context and `long_factor` beyond it, and cos/sin
    scaled by `attention_factor`."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float
