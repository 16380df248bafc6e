"""Allocating the KV cache tensors: how many blocks fit the memory we are allowed, in which dtype."""

from __future__ import annotations

import torch

from goodserve.config import EngineConfig
from goodserve.engine.setup.device_memory import release_dropped_memory
from goodserve.engine.setup.kv_groups import KVGroups, one_group
from goodserve.errors import InvalidRequestError
from goodserve.model.spec import ModelSpec
from goodserve.ops.attention import LayerKVCache

_GiB = 1 << 30


def kv_storage_dtype(config: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    return {"auto": model_dtype, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[config.kv_cache_dtype]


def bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
    """One block's K/V bytes; num_layers: the layers a block holds (default all; engine/setup/kv_groups.py)."""
    num_layers = spec.num_layers if num_layers is None else num_layers
    per_layer_token = 2 * spec.num_kv_heads * (spec.head_dim * dtype.itemsize
                                               + (4 if dtype == torch.int8 else 0))  # int8: a float32 scale a head
    return int(per_layer_token * num_layers * block_size)


def activation_reserve_bytes(spec: ModelSpec, config: EngineConfig, dtype: torch.dtype) -> int:
    """A generous bound on the forward pass's transient memory, kept out of the KV budget."""
    widest = max(spec.q_size + 2 * spec.kv_size, 2 * spec.intermediate_size)
    per_token = (4 * spec.hidden_size + 2 * widest) * dtype.itemsize
    logits = config.max_num_seqs * spec.vocab_size * 4 * 4  # logits, probs, sort buffers
    return config.max_num_batched_tokens * per_token + logits + _GiB


def num_blocks_for_memory(spec: ModelSpec, config: EngineConfig, device: torch.device,
                          model_dtype: torch.dtype, kv_dtype: torch.dtype, draft_bytes_per_block: int = 0,
                          layers_per_block: int | None = None) -> int:
    """Blocks of the pool: as many as the budget holds, each of layers_per_block layers' K/V (default
    all of spec's) with a draft model's block beside it (draft_bytes_per_block: its pool has as many
    blocks; the draft's weights are on the device already, so counted in what is used)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if device.type == "cuda":
        release_dropped_memory()  # an engine dropped before this one is not "already used"
        free, total = torch.cuda.mem_get_info(device)
        already_used = total - free
        budget = total * config.gpu_memory_utilization - already_used
        budget -= activation_reserve_bytes(spec, config, model_dtype)
    else:
        budget = config.cpu_kv_cache_bytes
    block_bytes = bytes_per_block(spec, config.block_size, kv_dtype, layers_per_block)
    num_blocks = int(budget // (block_bytes + draft_bytes_per_block))
    if num_blocks < 2:
        raise InvalidRequestError(
            f"no room for the KV cache ({budget / _GiB:.2f} GiB left for it on {device}): raise "
            "gpu_memory_utilization (or cpu_kv_cache_bytes), lower max_num_batched_tokens, "
            "or use a smaller or quantized model"
        )
    return num_blocks


def allocate_kv_cache(spec: ModelSpec, num_blocks: int, block_size: int, device: torch.device,
                      kv_dtype: torch.dtype, groups: KVGroups | None = None,
                      layers: range | None = None) -> list[LayerKVCache]:
    """The K/V pools of `layers` (default all of spec's), in their order: a tensor per slot of the
    layer groups (default one group of them all; engine/setup/kv_groups.py) that they use, each layer
    reading its own slot at its group's block ids."""
    layers = range(spec.num_layers) if layers is None else layers
    groups = groups or one_group(len(layers))
    slots = groups.slots(layers)
    shape = (len(slots), num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    k, v = torch.zeros(shape, dtype=kv_dtype, device=device), torch.zeros(shape, dtype=kv_dtype, device=device)
    scales = None
    if kv_dtype == torch.int8:
        scales = torch.ones((2, *shape[:-1]), dtype=torch.float32, device=device)
    caches = []
    for layer in layers:
        group, slot = groups.place(layer)
        i = slots.index(slot)
        caches.append(LayerKVCache(k[i], v[i], scales[0, i] if scales is not None else None,
                                   scales[1, i] if scales is not None else None, group))
    return caches


def kv_read_ratio(spec: ModelSpec, kv_dtype: torch.dtype, model_dtype: torch.dtype) -> float:
    """A token's K/V bytes over the weights' bytes: the step-time model's prior for what a decode row's
    attention pays per token of context, as a share of what a step pays to read the weights (a
    memory-bound decode step reads both at the same bandwidth; engine/core/step_time_model.py). Quantized
    weights are counted at the model dtype: the prior is then low, and the measured steps correct it."""
    return bytes_per_block(spec, 1, kv_dtype) / (spec.num_params() * model_dtype.itemsize)
