"""One native call for all decoder layers of a CPU decode step (native/decoder_layer.cpp).

A CPU decode step of a small int4 model spends as much time in Python around its kernels as in
them: a dozen calls per layer at ~10-20 us each. Where every layer's four linears take the native
int4 kernel, `attach` gives the model a `NativeDecodeStack`, and its forward hands it every step it
can run: one query per sequence, float32 activations and K/V, few enough rows. Everything else
(prefill, other dtypes, int8 / fp8 KV) stays on the per-op path, which is also the reference.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from goodserve.native.build import library
from goodserve.native.layer_ops import F32, I32, block_tables_operand, kv_pools
from goodserve.native.operands import NativeOperandError, operand
from goodserve.quant.linear import CPU_NATIVE_MAX_M, Int4Linear

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class LayerOperands(ctypes.Structure):
    """decoder_layer.cpp's LayerOperands, field for field."""

    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _P), ("qkv_bias", _P), ("o", _P), ("gate_up", _P),
                ("down", _P), ("qkv_group", _I), ("o_group", _I), ("gate_up_group", _I), ("down_group", _I),
                ("hidden", _I), ("inter", _I), ("q_heads", _I), ("kv_heads", _I), ("head_dim", _I),
                ("eps", _F), ("scale", _F), ("int8_activations", ctypes.c_int32), ("half_scales", ctypes.c_int32)]


def _linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _native(layer: nn.Module) -> bool:
    """Whether the native call can run this layer: four int4 linears on the native kernel, one
    activation arithmetic and scale width for all four, float32 norms, no biases but q/k/v's, no
    sliding window (the stack's attention sees the whole context)."""
    linears = _linears(layer)
    return (layer.self_attn.window is None and all(isinstance(lin, Int4Linear) and lin.native_layout() is not None for lin in linears)
            and all(lin.bias is None for lin in linears[1:]) and layer.self_attn.head_dim % 16 == 0
            and len({(lin.native_layout().int8_activations, lin.native_layout().half_scales) for lin in linears}) == 1
            and all(norm.weight.dtype == torch.float32 and norm.weight.is_contiguous()
                    for norm in (layer.input_layernorm, layer.post_attention_layernorm)))


def attach(model: nn.Module) -> bool:
    """Give the model its native decode path if every decoder layer can take it; returns whether.
    The native layer has no q/k norms, no mixture of experts and none of Gemma's parts (norms after the
    sublayers and scaled by 1 + weight, GeGLU, soft-capped scores)."""
    layers, spec = list(model.model.layers), model.spec
    plain = not (spec.qk_norm or spec.is_moe or spec.sandwich_norms or spec.norm_weight_offset
                 or spec.hidden_act != "silu" or spec.attn_logit_softcap is not None)
    model.native_decode = NativeDecodeStack(layers) if plain and all(_native(layer) for layer in layers) else None
    return model.native_decode is not None


class NativeDecodeStack:
    """The decoder layers of a decode step as one native call (the layers' forward, in order)."""

    def __init__(self, layers: list[nn.Module]):
        self.layers = [NativeDecodeLayer(layer) for layer in layers]
        self._array = None  # the layers' LayerOperands side by side
        self._watched: list[tuple] = []  # (holder dict, key, value, version): what the array was built from
        self._kv = ((), None)  # the K/V pools last checked, and their pointer arrays

    @staticmethod
    def takes(x: torch.Tensor, kv_cache, meta) -> bool:
        """Whether the stack runs this step (kv_cache: the first layer's; all share its dtype)."""
        return (meta.is_decode_only and meta.branches is None and meta.kv_exchange is None
                and x.shape[0] <= CPU_NATIVE_MAX_M
                and x.dtype == torch.float32 and kv_cache.k.dtype == torch.float32 and not x.is_cuda)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, rotary_cache: torch.Tensor,
                 kv_caches: list, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the embeddings [T, hidden] -> (the last layer's output, its residual stream)."""
        first = self.layers[0].layer.self_attn
        x = operand("x", x.contiguous(), F32, (None, self.layers[0].linears[0].in_features))
        tokens = x.shape[0]
        positions, slots, seq_lens = (operand(name, t.to(I32).contiguous(), I32, (tokens,)) for name, t in
                                      (("positions", positions), ("slot_mapping", meta.slot_mapping),
                                       ("seq_lens", meta.seq_lens)))
        operand("rotary_cache", rotary_cache, F32, (None, first.head_dim))
        k_pools, v_pools = self._kv_pools(kv_caches)
        tables = block_tables_operand(meta.block_tables, tokens)
        out, residual = torch.empty_like(x), torch.empty_like(x)
        library().gs_decoder_stack(
            self.operands(), len(self.layers), k_pools, v_pools, x.data_ptr(), out.data_ptr(), residual.data_ptr(),
            tokens, positions.data_ptr(), rotary_cache.data_ptr(), slots.data_ptr(), kv_caches[0].k.shape[1],
            tables.data_ptr(), tables.stride(0), tables.stride(1), seq_lens.data_ptr(), torch.get_num_threads())
        return out, residual

    def operands(self):
        """Every layer's LayerOperands in one array, rebuilt when a weight it points into changed."""
        if self._array is None or not self._unchanged():
            self._array = (LayerOperands * len(self.layers))(*(layer.build() for layer in self.layers))
            self._watched = [watch for layer in self.layers for watch in layer.watched()]
        return self._array

    def _unchanged(self) -> bool:
        # One flat pass a step (~50 us for 30 layers), not a call chain per linear: the tensors are
        # the same objects (not replaced), unwritten (same version; inference tensors keep none),
        # and the activation flags as they were.
        return all(holder.get(name) is value and (version is None or value._version == version)
                   for holder, name, value, version in self._watched)

    def _kv_pools(self, kv_caches: list):
        """Pointer arrays of the layers' K and V pools, checked when the pools are new."""
        pools = tuple(t for cache in kv_caches for t in (cache.k, cache.v))
        if len(pools) != len(self._kv[0]) or any(a is not b for a, b in zip(pools, self._kv[0])):
            if len(kv_caches) != len(self.layers):
                raise NativeOperandError(f"{len(kv_caches)} K/V caches for {len(self.layers)} layers")
            for layer, cache in zip(self.layers, kv_caches):
                attn = layer.layer.self_attn
                kv_pools(cache.k, cache.v, attn.num_kv_heads, attn.head_dim)
                if cache.k.shape[1] != kv_caches[0].k.shape[1]:
                    raise NativeOperandError("the layers' K/V pools have different block sizes")
            pointers = [(_P * len(kv_caches))(*(t.data_ptr() for t in pools[i::2])) for i in (0, 1)]
            self._kv = (pools, pointers)
        return self._kv[1]


class NativeDecodeLayer:
    """One layer's LayerOperands, and what they are built from."""

    def __init__(self, layer: nn.Module):
        self.layer = layer
        self.linears = _linears(layer)
        self.norms = (layer.input_layernorm, layer.post_attention_layernorm)

    def watched(self) -> list[tuple]:
        """(holder dict, key, value, version) of everything the struct is built from."""
        tensors = [(lin._buffers, name) for lin in self.linears for name in ("qweight", "scales", "zeros")]
        tensors += [(norm._parameters, "weight") for norm in self.norms] + [(self.linears[0]._parameters, "bias")]
        flags = [(vars(lin), "int8_activations") for lin in self.linears]
        return ([(holder, name, holder.get(name), _version(holder.get(name))) for holder, name in tensors]
                + [(holder, name, holder[name], None) for holder, name in flags])

    def build(self) -> LayerOperands:
        qkv = self.linears[0]
        return self._build((*[lin.native_layout() for lin in self.linears], *[n.weight for n in self.norms], qkv.bias))

    def _build(self, pointed: tuple) -> LayerOperands:
        layouts, (input_norm, post_norm, qkv_bias) = pointed[:4], pointed[4:]
        attn = self.layer.self_attn
        hidden, inter = self.linears[0].in_features, self.linears[3].in_features
        q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        shapes = {"qkv": (hidden, q_size + 2 * kv_size), "o": (q_size, hidden), "gate_up": (hidden, 2 * inter),
                  "down": (inter, hidden)}
        for (name, (k, n)), layout in zip(shapes.items(), layouts):
            layout.check(name, k, n)
        for name, norm in (("input_norm", input_norm), ("post_norm", post_norm)):
            operand(name, norm, F32, (hidden,))
        if qkv_bias is not None:
            operand("qkv_bias", qkv_bias, F32, (self.linears[0].out_features,))
        return LayerOperands(
            input_norm.data_ptr(), post_norm.data_ptr(), layouts[0].tiles.data_ptr(),
            None if qkv_bias is None else qkv_bias.data_ptr(), *(layout.tiles.data_ptr() for layout in layouts[1:]),
            *(layout.group_size for layout in layouts), hidden, inter,
            attn.num_heads, attn.num_kv_heads, attn.head_dim, self.norms[0].eps, attn.scale,
            int(layouts[0].int8_activations), int(layouts[0].half_scales))


def _version(t: torch.Tensor | None) -> int | None:
    return None if t is None or t.is_inference() else t._version
