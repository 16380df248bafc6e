"""`dummy:<preset>`: random weights of a real model's shape, for benchmarking (vLLM --load-format dummy).

Weights are drawn on the target device in the target dtype, so an 8B model appears in seconds on a
GPU and is never materialized on the CPU.
"""

from __future__ import annotations

import torch

from goodserve.model.llama import LlamaForCausalLM, build_empty_model
from goodserve.model.spec import ModelSpec

# Small enough that activations stay finite through dozens of layers in bf16.
INIT_STD = 0.02


@torch.no_grad()
def init_random_weights(model: LlamaForCausalLM, seed: int) -> None:
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, INIT_STD, generator=generator)


def load_dummy(spec: ModelSpec, dtype: torch.dtype, device: torch.device, seed: int) -> LlamaForCausalLM:
    model = build_empty_model(spec, dtype, device)
    init_random_weights(model, seed)
    return model
