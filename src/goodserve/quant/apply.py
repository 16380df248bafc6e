"""Swap a model's transformer linears for quantized ones, in place.

The per-layer projections hold nearly all the bytes a decode step reads and are quantized with
the chosen method. lm_head is optional (lm_head=True): it is a large read too (1.05 GB of the
16 GB a Llama-3.1-8B bf16 step reads, a fifth of an int4 step), but it is where quantization
error hurts the output distribution most directly, so it gets int8 per output channel by default (error <= half a step of 1/127 of the
row's largest weight), whatever the method; lm_head_method="int4" asks for int4 with the layers'
group size instead (half int8's bytes: 112 against 185 us a token at Llama-3.1-8B's 128256 x 4096
on an H100, benchmarks/BENCHMARKS.md). In a model with
tied embeddings lm_head's weight is the embedding table: the quantized lm_head is a new module
with its own codes, and the embedding keeps its float table for lookups. Embeddings themselves
stay as they are (a lookup reads one row per token).

Under tensor parallelism each rank quantizes its shard to the codes of the whole matrix's slice:
int4 groups run along the input, so a row-parallel shard (o_proj, down_proj: a slice of the input)
keeps the group size the whole model would get, and must hold whole groups; int8 and fp8 scales run
per output row, so a row-parallel shard takes each row's largest magnitude over all ranks.

fp8 (quant/fp8_linear.py) quantizes the activations too, per token, and multiplies on FP8 tensor
cores; its lm_head choice is the same (int8 by default when asked).
"""

from __future__ import annotations

import torch
from torch import nn

from goodserve.config import LM_HEAD_QUANTIZATIONS
from goodserve.errors import InvalidRequestError
from goodserve.quant import schemes
from goodserve.quant.fp8_linear import Fp8Linear, check_fp8_shape
from goodserve.quant.linear import Int4Linear, Int8Linear

TARGET_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
ROW_PARALLEL_LINEARS = ("o_proj", "down_proj")  # under tensor parallelism: a slice of the input columns
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def target_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent module, attribute name, linear) for every linear quantize_model replaces."""
    found = []
    for parent in model.modules():
        for name in TARGET_LINEARS:
            child = getattr(parent, name, None)
            if isinstance(child, nn.Linear):
                found.append((parent, name, child))
    return found


def check_quantizable(targets: list[tuple[nn.Module, str, nn.Linear]], method: str, group_size: int,
                      shards: int = 1) -> None:
    """shards: the tensor-parallel size the linears are a rank's share of."""
    schemes.check_method(method)
    if not targets:
        raise InvalidRequestError(f"no linear layers named {TARGET_LINEARS} to quantize in this model")
    for _, name, linear in targets:
        dtype = linear.weight.dtype
        if dtype not in SUPPORTED_DTYPES:
            raise InvalidRequestError(
                f"{method} quantization needs float32, bfloat16 or float16 activations; "
                f"{name} is {str(dtype).removeprefix('torch.')} on {linear.weight.device}")
        split = shards > 1 and name in ROW_PARALLEL_LINEARS
        layer = f"{name} (its 1/{shards} tensor-parallel shard)" if split else name
        if method == "int4":
            schemes.check_group_size(linear.in_features, group_size, layer)
        elif method == "fp8":
            check_fp8_shape(layer, linear.in_features, linear.out_features)


def auto_group_size(targets: list[tuple[nn.Module, str, nn.Linear]], shards: int = 1) -> int:
    """The largest int4 group size dividing every layer's whole input (smollm2's 576 rules out 128)."""
    for size in sorted(schemes.INT4_GROUP_SIZES, reverse=True):
        if all(_whole_in_features(name, linear, shards) % size == 0 for _, name, linear in targets):
            return size
    return max(schemes.INT4_GROUP_SIZES)  # none fits: check_quantizable names the layer


def _whole_in_features(name: str, linear: nn.Linear, shards: int) -> int:
    return linear.in_features * (shards if name in ROW_PARALLEL_LINEARS else 1)


def _row_absmax(name: str, linear: nn.Linear, tp) -> torch.Tensor | None:
    """A row-parallel shard's rows' largest magnitudes over every rank's columns (tp: the model's
    model/tensor_parallel.TensorParallel, None for a model that is not split)."""
    if tp is None or tp.size == 1 or name not in ROW_PARALLEL_LINEARS:
        return None
    return tp.all_reduce_max(linear.weight.detach().abs().amax(dim=1).float())


def lm_head_target(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """[(model, "lm_head", linear)], the form target_linears returns; refuses a model without one."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        raise InvalidRequestError(f"this model has no float nn.Linear lm_head to quantize "
                                  f"(found {type(head).__name__})")
    return [(model, "lm_head", head)]


def quantize_model(model: nn.Module, method: str, group_size: int | None = 128,
                   awq_calibration_ids: list[int] | None = None, lm_head: bool = False,
                   lm_head_method: str = "int8") -> nn.Module:
    """Replace qkv_proj / o_proj / gate_up_proj / down_proj with Int8Linear, Int4Linear or Fp8Linear, and with
    lm_head=True lm_head with an Int8Linear (lm_head_method "int8") or an Int4Linear of the layers'
    group size ("int4"; see the module doc).

    group_size None picks the largest of 128 / 64 / 32 that divides every layer; a size given
    explicitly that does not divide is an error. Checks every layer before changing any, so bad
    input leaves the model untouched. With calibration token ids, AWQ rescales the float weights
    first (quant/awq.py).
    """
    targets = target_linears(model)
    tp = getattr(model, "tp", None)  # the model's split (quant/ does not import model/)
    shards = tp.size if tp is not None else 1
    group_size = group_size or auto_group_size(targets, shards)
    check_quantizable(targets, method, group_size, shards)
    head = lm_head_target(model) if lm_head else []
    if head:
        check_lm_head_method(lm_head_method, method)
        check_quantizable(head, lm_head_method, group_size)
    if awq_calibration_ids:
        from goodserve.quant.awq import apply_awq

        apply_awq(model, awq_calibration_ids, method, group_size)
    for parent, name, linear in targets:
        setattr(parent, name, _quantized_linear(method, name, linear, group_size, tp))
    for parent, name, linear in head:
        quantized = Int8Linear.from_linear(linear) if lm_head_method == "int8" \
            else Int4Linear.from_linear(linear, group_size)
        setattr(parent, name, quantized)
    return model


def _quantized_linear(method: str, name: str, linear: nn.Linear, group_size: int, tp) -> nn.Module:
    if method == "int4":
        return Int4Linear.from_linear(linear, group_size)
    cls = Int8Linear if method == "int8" else Fp8Linear
    return cls.from_linear(linear, _row_absmax(name, linear, tp))


def check_lm_head_method(lm_head_method: str, method: str) -> None:
    """An int4 lm_head takes the layers' group size, so it needs int4 layers."""
    if lm_head_method not in LM_HEAD_QUANTIZATIONS:
        raise InvalidRequestError(f"lm_head quantization must be one of {LM_HEAD_QUANTIZATIONS}, got {lm_head_method!r}")
    if lm_head_method == "int4" and method != "int4":
        raise InvalidRequestError(f"an int4 lm_head needs int4 layers (quantization {method!r}): use an int8 lm_head")


def empty_quantized_like(model: nn.Module, method: str, group_size: int, lm_head: str | None = None) -> nn.Module:
    """Same swap without computing codes: the skeleton a pre-quantized checkpoint loads into.
    lm_head: its method ("int8" / "int4"), None for a float lm_head."""
    targets = target_linears(model)
    check_quantizable(targets, method, group_size)
    head = lm_head_target(model) if lm_head else []
    if head:
        check_lm_head_method(lm_head, method)
        check_quantizable(head, lm_head, group_size)
    for parent, name, linear in targets + head:
        w = linear.weight
        args = (linear.in_features, linear.out_features, linear.bias is not None)
        layer_method = lm_head if name == "lm_head" else method
        if layer_method == "int4":
            quantized = Int4Linear(*args, group_size=group_size, dtype=w.dtype, device=w.device)
        else:
            quantized = (Int8Linear if layer_method == "int8" else Fp8Linear)(*args, dtype=w.dtype, device=w.device)
        setattr(parent, name, quantized)
    return model
