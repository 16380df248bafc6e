"""Weight-only quantization schemes for an nn.Linear weight W [N, K] (out_features x in_features).

- int8: per output channel, symmetric. W ~= q * scale[n], q in [-127, 127]; error <= scale / 2.
- int4: per group of `group_size` input columns, asymmetric. W ~= q * scale[n, g] + zero[n, g],
  q in [0, 15]; the zero point is stored as a float (the value code 0 stands for, i.e. the group
  minimum, as gpt-fast / tinygemm do) so each group's [min, max] maps exactly onto the 16 codes and
  the error is <= scale / 2. Two codes share a byte: column 2j in the low nibble, 2j + 1 in the high.
- fp8: per output channel, float8_e4m3fn. W ~= q * scale[n] with scale = row amax / 448 (e4m3's
  largest finite value), so each row's largest weight maps onto 448; q keeps 3 mantissa bits, a
  relative error <= 2^-4 down to e4m3's normal range. The activations are quantized the same way per
  token at run time (quant/fp8_linear.py), not here.

Quantization math runs in float32 whatever the weight's dtype; scales and zeros stay float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from goodserve.config import WEIGHT_QUANTIZATIONS
from goodserve.errors import InvalidRequestError

INT8_MAX = 127
INT4_MAX_CODE = 15
INT4_GROUP_SIZES = (32, 64, 128)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# Keeps all-zero rows / constant groups from dividing by zero; they then dequantize exactly.
MIN_SCALE = 1e-10


@dataclass
class Int8Weight:
    qweight: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N] float32


@dataclass
class Fp8Weight:
    qweight: torch.Tensor  # [N, K] float8_e4m3fn
    scales: torch.Tensor  # [N] float32


@dataclass
class Int4Weight:
    qweight: torch.Tensor  # [N, K // 2] uint8, two codes per byte
    scales: torch.Tensor  # [N, K // group_size] float32
    zeros: torch.Tensor  # [N, K // group_size] float32, value of code 0
    group_size: int


def check_method(method: str) -> None:
    if method not in WEIGHT_QUANTIZATIONS:
        raise InvalidRequestError(f"quantization must be one of {WEIGHT_QUANTIZATIONS}, got {method!r}")


def check_group_size(in_features: int, group_size: int, layer: str = "weight") -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise InvalidRequestError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if in_features % group_size:
        raise InvalidRequestError(
            f"int4 group size {group_size} does not divide {layer}'s input dimension {in_features}; "
            f"choose a group size from {INT4_GROUP_SIZES} that divides it"
        )


def quantize_int8(weight: torch.Tensor, row_absmax: torch.Tensor | None = None) -> Int8Weight:
    """row_absmax: each row's largest magnitude when `weight` holds only some of its columns (a
    tensor-parallel shard), so the shard gets the whole matrix's codes."""
    w = weight.detach().float()
    scales = ((w.abs().amax(dim=1) if row_absmax is None else row_absmax) / INT8_MAX).clamp(min=MIN_SCALE)
    qweight = torch.round(w / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(qweight, scales)


def dequantize_int8(q: Int8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.qweight.float() * q.scales[:, None]).to(dtype)


def quantize_fp8(weight: torch.Tensor, row_absmax: torch.Tensor | None = None) -> Fp8Weight:
    """row_absmax: as quantize_int8's (a tensor-parallel shard gets the whole matrix's scales)."""
    w = weight.detach().float()
    scales = ((w.abs().amax(dim=1) if row_absmax is None else row_absmax) / FP8_MAX).clamp(min=MIN_SCALE)
    qweight = (w / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(qweight, scales)


def dequantize_fp8(q: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.qweight.float() * q.scales[:, None]).to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] with values 0..15 -> [N, K // 2] uint8 (even column low nibble)."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K // 2] uint8 -> codes [N, K] uint8."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4Weight:
    n, k = weight.shape
    check_group_size(k, group_size)
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((high - low) / INT4_MAX_CODE).clamp(min=MIN_SCALE)
    codes = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, INT4_MAX_CODE)
    return Int4Weight(pack_int4(codes.reshape(n, k)), scales, low, group_size)


def dequantize_int4(q: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n = q.qweight.shape[0]
    codes = unpack_int4(q.qweight).float().reshape(n, -1, q.group_size)
    w = codes * q.scales[..., None] + q.zeros[..., None]
    return w.reshape(n, -1).to(dtype)


# The tensors each method's codes are made of (quantized experts' buffers, model/moe.py).
CODE_PARTS = {"int8": ("qweight", "scales"), "int4": ("qweight", "scales", "zeros")}


def empty_codes(method: str, rows: int, cols: int, group_size: int | None = None) -> dict[str, torch.Tensor]:
    """Uninitialized codes of a [rows, cols] weight, by part (CODE_PARTS)."""
    if method == "int8":
        return {"qweight": torch.empty(rows, cols, dtype=torch.int8), "scales": torch.empty(rows, dtype=torch.float32)}
    groups = cols // group_size
    return {"qweight": torch.empty(rows, cols // 2, dtype=torch.uint8),
            "scales": torch.empty(rows, groups, dtype=torch.float32),
            "zeros": torch.empty(rows, groups, dtype=torch.float32)}


def rows_of(q: Int8Weight | Int4Weight, rows: slice) -> Int8Weight | Int4Weight:
    """Some rows of quantized codes (views: writing them writes q)."""
    if isinstance(q, Int8Weight):
        return Int8Weight(q.qweight[rows], q.scales[rows])
    return Int4Weight(q.qweight[rows], q.scales[rows], q.zeros[rows], q.group_size)


def quantize_like(q: Int8Weight | Int4Weight, weight: torch.Tensor,
                  row_absmax: torch.Tensor | None = None) -> Int8Weight | Int4Weight:
    """`weight`'s codes in q's method (and group size); row_absmax as quantize_int8's (int4's groups
    need none: a shard holds whole groups)."""
    return quantize_int8(weight, row_absmax) if isinstance(q, Int8Weight) else quantize_int4(weight, q.group_size)


def copy_rows(target: Int8Weight | Int4Weight, source: Int8Weight | Int4Weight) -> None:
    target.qweight.copy_(source.qweight)
    target.scales.copy_(source.scales)
    if isinstance(target, Int4Weight):
        target.zeros.copy_(source.zeros)


def dequantize(q: Int8Weight | Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize_int8(q, dtype) if isinstance(q, Int8Weight) else dequantize_int4(q, dtype)
