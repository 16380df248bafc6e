"""Llama-3 rope scaling's parameters, apart from the rotary op (rotary.py): a model's shape
(model/spec.py) carries them, and shapes are read without torch (the calculators, the bench)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
