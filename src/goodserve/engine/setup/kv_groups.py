"""The KV pool's layer groups: which layers share a block, and how much each group keeps.

A model whose layers all keep the same context (every layer global, or every layer with one sliding
window) has one group: a block holds every layer's K/V of `block_size` tokens. A hybrid model (Gemma
2/3: local sliding-window layers beside global ones) would waste most of that: its local layers read
only their last `window` tokens, while an all-global block keeps every layer's K/V of every token.
So, as vLLM's hybrid KV cache manager does, its layers are split into groups of one kind each, all of
the same size S (the smaller kind's layer count; the last group of a kind may be short), and a block
holds the K/V of one group's S layers. Every group draws its blocks from the one pool and has its own
block table per sequence: a global group's grows with the sequence, a local group's keeps only the
blocks its window still reads (engine/core/kv_cache_manager.py releases the others). Gemma 3 (5 local
layers to 1 global) so holds a 32k-token sequence in about a sixth of the all-global bytes.

Pool memory: S tensors of [num_blocks, block_size, kv_heads, head_dim] for K and as many for V; the
group's i-th layer reads and writes the i-th (its slot) at its group's block ids. Pipeline stages keep
one group (each stage holds a part of every group's layers, so most of its slots would sit unused), and
so do context-parallel ranks (their exchange of new K/V rows addresses one slot mapping).
"""

from __future__ import annotations

from dataclasses import dataclass

from goodserve.config import EngineConfig
from goodserve.model.spec import ModelSpec


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: its layers' sliding window (None: they keep every block)
    layers: tuple[tuple[int, ...], ...]  # per group: its layers, a layer's slot being its index here

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def is_hybrid(self) -> bool:
        return self.num_groups > 1

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot) of a layer."""
        return next((g, layers.index(layer)) for g, layers in enumerate(self.layers) if layer in layers)

    def slots(self, layers: range) -> list[int]:
        """The slots these layers (a pipeline stage's, or all) use: what one block holds of them."""
        return sorted({self.place(layer)[1] for layer in layers})

    def blocks_held(self, tokens: int, step_tokens: int, block_size: int) -> int:
        """Blocks one sequence holds while a step computes up to step_tokens tokens that take it to
        `tokens`: a global group's cover them all; a local group's its window before the step's first
        token and the step's tokens (the blocks before go once the step is done)."""
        every = -(-tokens // block_size)
        return sum(every if w is None else min(every, -(-(w - 1 + step_tokens) // block_size) + 1)
                   for w in self.windows)

    def longest_sequence(self, num_blocks: int, step_tokens: int, block_size: int, limit: int) -> int:
        """The most tokens (at most `limit`) one sequence can reach in a pool of num_blocks blocks."""
        low, high = 0, limit  # blocks_held grows with tokens: the last count that fits
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.blocks_held(mid, step_tokens, block_size) <= num_blocks else (low, mid - 1)
        return low


def one_group(num_layers: int, window: int | None = None) -> KVGroups:
    return KVGroups((window,), (tuple(range(num_layers)),))


def kv_groups(spec: ModelSpec, config: EngineConfig) -> KVGroups:
    """The model's groups: one per kind of layer and S of its layers (see above), or one group when
    every layer keeps the same context or the model runs in pipeline stages or context-parallel ranks."""
    windows = spec.layer_windows or (None,) * spec.num_layers
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_window.setdefault(window, []).append(layer)
    if len(by_window) == 1 or config.pipeline_parallel_size > 1 or config.context_parallel_size > 1:
        return one_group(spec.num_layers, spec.window_of_every_layer)
    size = min(map(len, by_window.values()))
    groups = [(window, tuple(layers[i : i + size])) for window, layers in by_window.items()
              for i in range(0, len(layers), size)]
    return KVGroups(tuple(w for w, _ in groups), tuple(layers for _, layers in groups))
