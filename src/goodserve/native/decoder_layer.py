"""One native call per decoder layer in CPU decode steps (decoder_layer.cpp).

A CPU decode step of a small int4 model spends as much time in Python around its kernels as in
them: a dozen calls per layer at ~10-20 us each. Where a layer's four linears take the native int4
kernel, `attach` gives the layer a `NativeDecodeLayer`, and the layer's forward hands it every step
it can run: one query per sequence, float32 activations and K/V, few enough rows. Everything else
(prefill, other dtypes, int8 / fp8 KV) stays on the per-op path, which is also the reference.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from goodserve.native.build import library
from goodserve.quant.linear import CPU_NATIVE_MAX_M, Int4Linear

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class LayerOperands(ctypes.Structure):
    """decoder_layer.cpp's LayerOperands, field for field."""

    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _P), ("qkv_bias", _P), ("o", _P), ("gate_up", _P),
                ("down", _P), ("qkv_group", _I), ("o_group", _I), ("gate_up_group", _I), ("down_group", _I),
                ("hidden", _I), ("inter", _I), ("q_heads", _I), ("kv_heads", _I), ("head_dim", _I),
                ("eps", _F), ("scale", _F)]


def _linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def attach(model: nn.Module) -> int:
    """Give each decoder layer whose linears all take the native int4 kernel its native decode path;
    returns how many layers got one."""
    count = 0
    for layer in model.model.layers:
        linears = _linears(layer)
        if (all(isinstance(lin, Int4Linear) and lin.native_layout() is not None for lin in linears)
                and linears[1].bias is None and layer.self_attn.head_dim % 16 == 0
                and layer.input_layernorm.weight.dtype == torch.float32):
            layer.native_decode = NativeDecodeLayer(layer)
            count += 1
    return count


class NativeDecodeLayer:
    def __init__(self, layer: nn.Module):
        self.layer = layer
        self._operands: tuple[tuple, LayerOperands] | None = None  # (the tensors it points into, struct)

    @staticmethod
    def takes(x: torch.Tensor, kv_cache, meta) -> bool:
        return (meta.is_decode_only and x.shape[0] <= CPU_NATIVE_MAX_M and x.dtype == torch.float32
                and kv_cache.k.dtype == torch.float32 and not x.is_cuda)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                 rotary_cache: torch.Tensor, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.contiguous()
        out, residual_out = torch.empty_like(x), torch.empty_like(x)
        tables = meta.block_tables
        int32 = [t.to(torch.int32).contiguous() for t in (positions, meta.slot_mapping, meta.seq_lens)]
        library().gs_decoder_layer(
            ctypes.byref(self.operands()), x.data_ptr(), None if residual is None else residual.contiguous().data_ptr(),
            out.data_ptr(), residual_out.data_ptr(), x.shape[0], int32[0].data_ptr(), rotary_cache.data_ptr(),
            int32[1].data_ptr(), kv_cache.k.data_ptr(), kv_cache.v.data_ptr(), kv_cache.k.shape[1],
            tables.to(torch.int32).data_ptr(), tables.stride(0), tables.stride(1), int32[2].data_ptr(),
            torch.get_num_threads())
        return out, residual_out

    def operands(self) -> LayerOperands:
        """The struct of pointers, rebuilt when any layout it points into was rebuilt (new weights)."""
        layer = self.layer
        qkv, o, gate_up, down = linears = _linears(layer)
        layouts = tuple(lin.native_layout() for lin in linears)
        norms = (layer.input_layernorm.weight.contiguous(), layer.post_attention_layernorm.weight.contiguous())
        pinned = (*layouts, *norms, qkv.bias)
        if self._operands is None or any(a is not b for a, b in zip(self._operands[0], pinned)):
            attn = layer.self_attn
            struct = LayerOperands(
                norms[0].data_ptr(), norms[1].data_ptr(), layouts[0].tiles.data_ptr(),
                None if qkv.bias is None else qkv.bias.data_ptr(), layouts[1].tiles.data_ptr(),
                layouts[2].tiles.data_ptr(), layouts[3].tiles.data_ptr(),
                *(layout.group_size for layout in layouts), qkv.in_features, down.in_features, attn.num_heads,
                attn.num_kv_heads, attn.head_dim, layer.input_layernorm.eps, attn.scale)
            self._operands = (pinned, struct)
        return self._operands[1]
