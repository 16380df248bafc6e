"""Pipeline parallelism: which contiguous range of layers a stage holds, and the hand-off of the
hidden states between stages.

Stage s of M holds layers [s * L // M, (s + 1) * L // M): stage 0 also the embedding, the last stage
the final norm and lm_head (and the embedding too where lm_head is tied to it). Each stage sends its
last layer's output and residual to the rank of the same tensor-parallel index in the next stage
(point-to-point, one [2, T, hidden] tensor); every stage knows T, since each runs the same
scheduled step. Ranks are numbered stage-major: global rank = stage * tp_size + tp_rank.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from goodserve.errors import InvalidRequestError
from goodserve.model.spec import ModelSpec

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def check_pipeline_parallel_size(spec: ModelSpec, size: int) -> None:
    """Every stage needs at least one layer."""
    if not 1 <= size <= spec.num_layers:
        raise InvalidRequestError(
            f"--pipeline-parallel-size {size} does not split {spec.name}: each stage needs at least one of its "
            f"{spec.num_layers} layers (valid sizes: 1 to {spec.num_layers})")


@dataclass(frozen=True)
class PipelineParallel:
    stage: int = 0
    size: int = 1
    tp_size: int = 1  # ranks per stage: the peer of a rank in the next stage is tp_size ranks on

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def layers(self, num_layers: int) -> range:
        return range(self.stage * num_layers // self.size, (self.stage + 1) * num_layers // self.size)

    def local_spec(self, spec: ModelSpec) -> ModelSpec:
        """The stage's own depth (what its KV cache is sized by)."""
        return dataclasses.replace(spec, num_layers=len(self.layers(spec.num_layers)))

    def holds_embedding(self, spec: ModelSpec) -> bool:
        return self.is_first or (self.is_last and spec.tie_word_embeddings)

    def holds(self, name: str, spec: ModelSpec) -> bool:
        """Whether a checkpoint tensor of the whole model belongs to this stage."""
        if (layer := _LAYER.match(name)) is not None:
            return int(layer.group(1)) in self.layers(spec.num_layers)
        if name.startswith("model.embed_tokens."):
            return self.holds_embedding(spec)
        return self.is_last  # the final norm, lm_head

    # ---- the hand-off ----------------------------------------------------------------------
    def send_forward(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        dist.send(torch.stack([x, residual]), dst=dist.get_rank() + self.tp_size)

    def receive_from_previous(self, num_tokens: int, hidden_size: int,
                              like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's (hidden states, residual) for a step of num_tokens tokens (like: a
        tensor of the model's dtype and device)."""
        both = like.new_empty((2, num_tokens, hidden_size))
        dist.recv(both, src=dist.get_rank() - self.tp_size)
        return both[0], both[1]
