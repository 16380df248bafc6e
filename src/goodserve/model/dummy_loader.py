"""`dummy:<preset>`: random weights of a real model's shape, for benchmarking (vLLM --load-format dummy).

Weights are drawn on the target device in the target dtype, so an 8B model appears in seconds on a
GPU and is never materialized on the CPU. Under tensor parallelism each rank draws every whole
(TP=1) tensor in turn from the same seed and keeps its slice (a pipeline stage: its layers' tensors),
so any TP and PP size runs the same model.
"""

from __future__ import annotations

import torch

from goodserve.model.llama import LlamaForCausalLM, WeightFiller, build_empty_model
from goodserve.model.pipeline_parallel import PipelineParallel
from goodserve.model.spec import ModelSpec
from goodserve.model.tensor_parallel import TensorParallel

# Small enough that activations stay finite through dozens of layers in bf16.
INIT_STD = 0.02


@torch.no_grad()
def init_random_weights(model: LlamaForCausalLM, seed: int) -> None:
    device, dtype = model.rotary_cache.device, next(model.parameters()).dtype
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        whole = LlamaForCausalLM(model.spec)  # the TP=1 shapes, in the TP=1 order of draws
    filler = WeightFiller(model)
    for name, param in whole.named_parameters():
        full = torch.empty(param.shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            full.fill_(1.0 - model.spec.norm_weight_offset)  # a scale of 1 (Gemma scales by 1 + weight)
        elif name.endswith(".bias"):
            full.zero_()
        else:
            full.normal_(0.0, INIT_STD, generator=generator)
        filler.fill_whole(name, full)
    filler.finish()


def load_dummy(spec: ModelSpec, dtype: torch.dtype, device: torch.device, seed: int,
               tp: TensorParallel = TensorParallel(), pp: PipelineParallel = PipelineParallel(),
               quantization: str | None = None, group_size: int | None = None) -> LlamaForCausalLM:
    model = build_empty_model(spec, dtype, device, tp, pp, quantization, group_size)
    init_random_weights(model, seed)
    return model
