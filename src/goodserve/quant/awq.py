"""Activation-aware weight scaling (AWQ, Lin et al. 2023) before weight-only quantization.

Input channels that carry large activations matter most to a linear's output, so AWQ multiplies
those weight columns by s > 1 before quantizing (they lose less relative precision) and divides
the layer's input by s, folding 1/s into the op that produces that input, so the float model is
unchanged. s = mean|x|^alpha per channel, alpha searched on a calibration text to minimize the
layer's output error after quantization; alpha = 0 (no scaling) is in the grid, so on the
calibration text AWQ never does worse than plain rounding.

Folds: qkv_proj's input into input_layernorm's weight, gate_up_proj's into
post_attention_layernorm's, down_proj's into the up half of gate_up_proj (silu(gate) * up is
linear in up). o_proj is left alone: its input comes from attention, whose value heads are
shared across query heads under GQA, so no per-channel fold is exact there.
"""

from __future__ import annotations

import torch
from torch import nn

from goodserve.ops.attention import AttentionMetadata, LayerKVCache
from goodserve.quant import schemes

ALPHA_GRID = 20
MAX_CALIBRATION_TOKENS = 512
CALIBRATION_CHARS = 4000
CALIBRATION_BLOCK_SIZE = 16


def default_calibration_text() -> str:
    """The end of Python's pydoc_data.topics: offline, and apart from the start that eval scores."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))[-CALIBRATION_CHARS:]


def fake_quantize(weight: torch.Tensor, method: str, group_size: int) -> torch.Tensor:
    if method == "int8":
        return schemes.dequantize_int8(schemes.quantize_int8(weight))
    return schemes.dequantize_int4(schemes.quantize_int4(weight, group_size))


@torch.no_grad()
def capture_inputs(model: nn.Module, token_ids: list[int], linears: list[nn.Linear]) -> dict[nn.Linear, torch.Tensor]:
    """Run one prefill of token_ids through the model and keep each linear's input rows (float32)."""
    captured: dict[nn.Linear, torch.Tensor] = {}
    hooks = [lin.register_forward_pre_hook(lambda mod, args: captured.__setitem__(mod, args[0].float()))
             for lin in linears]
    try:
        spec, param = model.spec, next(model.parameters())
        ids = torch.tensor(token_ids[:MAX_CALIBRATION_TOKENS], device=param.device)
        t = len(ids)
        num_blocks = -(-t // CALIBRATION_BLOCK_SIZE)
        shape = (num_blocks, CALIBRATION_BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
        caches = [LayerKVCache(param.new_zeros(shape), param.new_zeros(shape)) for _ in range(spec.num_layers)]
        int32 = dict(dtype=torch.int32, device=ids.device)
        meta = AttentionMetadata(slot_mapping=torch.arange(t, device=ids.device),
                                 query_start_loc=torch.tensor([0, t], **int32), seq_lens=torch.tensor([t], **int32),
                                 block_tables=torch.arange(num_blocks, **int32)[None], max_query_len=t, max_seq_len=t,
                                 query_lens_host=[t], seq_lens_host=[t])
        model(ids, torch.arange(t, device=ids.device), caches, meta)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def best_scales(weight: torch.Tensor, inputs: torch.Tensor, method: str, group_size: int) -> torch.Tensor:
    """Per-input-channel s minimizing ||x W^T - (x / s) Q(W s)^T|| over the calibration rows."""
    w = weight.float()
    reference = inputs @ w.T
    magnitude = inputs.abs().mean(dim=0).clamp(min=1e-6)
    best, best_error = torch.ones_like(magnitude), float("inf")
    for step in range(ALPHA_GRID + 1):
        s = magnitude.pow(step / ALPHA_GRID)
        s = s / (s.max() * s.min()).sqrt()  # centre the scales around 1 so codes keep their range
        error = (inputs @ (fake_quantize(w * s, method, group_size) / s).T - reference).pow(2).mean().item()
        if error < best_error:
            best, best_error = s, error
    return best


@torch.no_grad()
def apply_awq(model: nn.Module, calibration_ids: list[int], method: str, group_size: int = 128) -> nn.Module:
    """Rescale the float model in place (its outputs do not change); quantize_model comes next."""
    schemes.check_method(method)
    layers = list(model.model.layers)
    linears = [lin for layer in layers
               for lin in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    inputs = capture_inputs(model, calibration_ids, linears)
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        s = best_scales(attn.qkv_proj.weight, inputs[attn.qkv_proj], method, group_size)
        _fold(attn.qkv_proj, s, layer.input_layernorm.weight)
        s = best_scales(mlp.gate_up_proj.weight, inputs[mlp.gate_up_proj], method, group_size)
        _fold(mlp.gate_up_proj, s, layer.post_attention_layernorm.weight)
        s = best_scales(mlp.down_proj.weight, inputs[mlp.down_proj], method, group_size)
        up_rows = mlp.gate_up_proj.weight[mlp.down_proj.in_features:]
        _fold(mlp.down_proj, s, up_rows, rows=True)
    return model


def _fold(linear: nn.Linear, s: torch.Tensor, producer: torch.Tensor, rows: bool = False) -> None:
    """W <- W diag(s); the producer of the linear's input is divided by s (per element or per row)."""
    linear.weight.mul_(s.to(linear.weight.dtype))
    producer.div_((s[:, None] if rows else s).to(producer.dtype))
