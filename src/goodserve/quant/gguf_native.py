"""GGUF block-quantized weights as goodserve's int4 layers, read as they are (no requantization).

llama.cpp quantizes each row in blocks of 32 weights, a float16 scale d (and minimum m) per block.
Three of its formats are exactly Int4Linear with group size 32:
- Q4_1: w = d q + m, q in 0..15  -> codes q, scale d, zero m
- Q4_0: w = d (q - 8)            -> codes q, scale d, zero -8 d
- Q8_0: w = d q, q in -128..127. A byte splits exactly as q = 16 hi + lo (hi = q >> 4 in -8..7,
  lo = q & 15 in 0..15), so w = 16 d hi + d lo: an int4 block with codes hi + 8, scale 16 d and
  zero -128 d, plus one with codes lo, scale d, zero 0. Side by side along the input they form one
  Int4Linear twice as wide, fed the input twice: x W^T = [x, x] [W_hi, W_lo]^T (Int8GroupLinear).
float16 d and m are exact in our float32 scales and every product above is exact in float32, so
`dequantize()` gives bit for bit what gguf's own dequantizer gives. Other GGUF types (K-quants,
float) are dequantized by the loader as before.

On the CPU, decode calls (up to 64 rows) take goodserve's native int4 kernel (native/int4_gemv.cpp)
with float32 rows, scales, zeros and output: the dequantized weight's product. With
`cpu_int8_activations` (EngineConfig) they run as llama.cpp runs these formats: each row quantized to
int8 per block of 32 (`Int4Linear.int8_activations`; needs AVX2 or AVX-512BW), integer dot products with
the codes, and the many-row calls multiply the same quantized rows. Q8_0 layers (the tied lm_head)
take their own native kernel instead (native/q8_gemv.cpp, int8 codes as they are: a third fewer
bytes than the two halves), always with float32 rows. Where the native library is
missing they fall back to torch's int4 kernel, which is fast only for bfloat16 rows (~15 GB/s
against < 1 GB/s for float32): those layers then round their rows, scales and zeros to bfloat16
(`Int4Linear.bf16_cpu_kernel`). Prefill-sized calls dequantize and stay in the model dtype.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from goodserve.native import q8_gemv
from goodserve.quant import schemes
from goodserve.quant.linear import CPU_NATIVE_MAX_M, CPU_PACKED_MAX_M, Int4Linear, matmul_path

GROUP_SIZE = 32  # every block format here
Q4_0, Q4_1, Q8_0 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
NATIVE_TYPES = (Q4_0, Q4_1, Q8_0)
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}  # float16 d, [float16 m], 16 bytes of nibbles or 32 int8


class Int8GroupLinear(nn.Module):
    """int8 codes with one scale per 32 inputs (Q8_0), stored as an Int4Linear over [x, x] (module doc).

    CPU calls of up to CPU_NATIVE_MAX_M rows take the native Q8_0 kernel (native/q8_gemv.cpp) on
    a layout rebuilt from those codes, with float32 rows whatever `cpu_int8_activations` says: it
    reads a third fewer bytes than the pair, and the logits keep full precision. Many-row calls
    multiply the dequantized weight, or `float_weight` when the model keeps that table anyway (a
    tied embedding), so prefill does not dequantize it every step.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 float_weight: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.pair = Int4Linear(2 * in_features, out_features, False, GROUP_SIZE, dtype, device)
        self.pair.bf16_cpu_kernel = True
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None
        self.float_weight = float_weight  # not registered: it belongs to the module that owns it
        self._q8_layout: tuple[tuple, q8_gemv.Q8Layout] | None = None  # keyed by the pair's codes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        native = x.device.type == "cpu" and q8_gemv.supports(self.in_features)
        path = matmul_path(x.device.type, rows.shape[0], CPU_NATIVE_MAX_M if native else CPU_PACKED_MAX_M)
        if path == "cpu_packed" and native:
            y = self._native_layout().matmul(rows.float()).to(x.dtype)
        elif path != "dequantized":  # the int4 kernels
            y = self.pair(torch.cat([rows, rows], dim=-1))
        else:  # many rows: one dense matmul (the pair would dequantize and multiply twice the width)
            weight = self.float_weight if self.float_weight is not None else self.dequantize(x.dtype)
            y = F.linear(rows, weight.to(x.dtype))
        y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def _native_layout(self) -> q8_gemv.Q8Layout:
        key = self.pair._codes_key()
        if self._q8_layout is None or self._q8_layout[0] != key:
            self._q8_layout = (key, q8_gemv.Q8Layout.from_codes(*self.codes()))
        return self._q8_layout[1]

    def codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The Q8_0 codes q (int8 [N, K]) and scales d ([N, K / 32]) the two halves hold."""
        halves = schemes.unpack_int4(self.pair.qweight).view(torch.int8)
        high, low = halves[:, : self.in_features], halves[:, self.in_features :]
        return 16 * (high - 8) + low, self.pair.scales[:, self.in_features // GROUP_SIZE :]

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: slice = slice(None)) -> torch.Tensor:
        halves = self.pair.dequantize(torch.float32, rows)
        return (halves[:, : self.in_features] + halves[:, self.in_features :]).to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, Q8_0 as two int4 halves"


def native_linear(tensor_type, linear: nn.Linear, float_weight: torch.Tensor | None = None) -> nn.Module:
    """An empty layer of `linear`'s shape that holds codes of `tensor_type` (one of NATIVE_TYPES)."""
    w = linear.weight
    args = (linear.in_features, linear.out_features, linear.bias is not None)
    if tensor_type == Q8_0:
        module = Int8GroupLinear(*args, dtype=w.dtype, device=w.device, float_weight=float_weight)
    else:
        module = Int4Linear(*args, group_size=GROUP_SIZE, dtype=w.dtype, device=w.device)
        module.bf16_cpu_kernel = True
    return module


def use_int8_activations(model: nn.Module) -> None:
    """The GGUF layers' CPU calls quantize their rows to int8 (EngineConfig.cpu_int8_activations)."""
    for module in model.modules():
        if isinstance(module, Int4Linear) and module.bf16_cpu_kernel:  # set on GGUF layers alone
            module.int8_activations = True


def int4_storage(module: nn.Module) -> Int4Linear:
    """The Int4Linear whose qweight / scales / zeros hold a native layer's codes."""
    return module.pair if isinstance(module, Int8GroupLinear) else module


def block_codes(data: np.ndarray, tensor_type) -> schemes.Int4Weight:
    """A GGUF tensor's raw blocks ([rows, bytes per row] uint8) as int4 codes in our layout."""
    raw = torch.from_numpy(np.array(data))  # a copy: the reader hands out a read-only memory map
    blocks = raw.view(raw.shape[0], -1, _BLOCK_BYTES[tensor_type])  # [N, groups, block bytes]
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    if tensor_type == Q8_0:
        q = blocks[..., 2:].contiguous().view(torch.int8).flatten(1)  # [N, K]
        codes = torch.cat([(q >> 4) + 8, q & 15], dim=1)  # hi + 8, lo: [N, 2K]
        scales, zeros = torch.cat([16 * d, d], dim=1), torch.cat([-128 * d, torch.zeros_like(d)], dim=1)
    else:
        nibbles = blocks[..., 4:] if tensor_type == Q4_1 else blocks[..., 2:]
        # Byte j of a block holds element j in its low nibble and element j + 16 in its high one.
        codes = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).flatten(1)
        scales = d
        zeros = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float() if tensor_type == Q4_1 \
            else -8 * d
    return schemes.Int4Weight(schemes.pack_int4(codes), scales, zeros, GROUP_SIZE)
