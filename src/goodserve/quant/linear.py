"""Weight-only quantized linear layers: drop-in nn.Linear replacements holding int8 / int4 codes.

forward(x) equals nn.Linear on the dequantized weight. Paths:
- CUDA: the Triton dequantize-GEMV / GEMM kernels (quant/triton_kernels.py).
- CPU, few rows (decode): torch's packed-weight kernels (_weight_int8pack_mm,
  _weight_int4pack_mm_for_cpu), which read the codes without materializing the weight.
- CPU, many rows (prefill): dequantize once, then one dense matmul; the dequantization is paid
  once per call and amortized over the rows, which beats the packed kernels there.
benchmarks/cpu_quant_linear.py measured the crossover (CPU_PACKED_MAX_M); docs/quantization.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from goodserve.quant import schemes

CPU_PACKED_MAX_M = 2
# torch's CPU int4 kernel takes codes 0..15 as (q - 8) * scale + zero8, so zero8 = zero + 8 * scale;
# it needs the output dimension to be a multiple of 16.
INT4_CPU_CODE_OFFSET = 8
INT4_CPU_N_MULTIPLE = 16


class _QuantizedLinear(nn.Module):
    """Shared shape, bias and dispatch; subclasses hold the codes and know their three paths."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if x.is_cuda:
            y = self._cuda_matmul(rows)
        elif rows.shape[0] <= CPU_PACKED_MAX_M:
            y = self._cpu_packed_matmul(rows)
        else:
            y = F.linear(rows, self.dequantize(rows.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(_QuantizedLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__(in_features, out_features, bias, dtype, device)
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.float32, device=device))

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        w = linear.weight
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype, w.device)
        q = schemes.quantize_int8(w)
        module.qweight.copy_(q.qweight)
        module.scales.copy_(q.scales)
        if linear.bias is not None:
            module.bias.copy_(linear.bias.detach())
        return module

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return schemes.dequantize_int8(schemes.Int8Weight(self.qweight, self.scales), dtype)

    def _cuda_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        from goodserve.quant.triton_kernels import int8_matmul

        return int8_matmul(rows, self.qweight, self.scales)

    def _cpu_packed_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(rows.contiguous(), self.qweight, self.scales.to(rows.dtype))


class Int4Linear(_QuantizedLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: int = 128,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        schemes.check_group_size(in_features, group_size)
        super().__init__(in_features, out_features, bias, dtype, device)
        self.group_size = group_size
        groups = in_features // group_size
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.ones(out_features, groups, dtype=torch.float32, device=device))
        self.register_buffer("zeros", torch.zeros(out_features, groups, dtype=torch.float32, device=device))
        # CPU kernel's own weight layout, built on first use; not part of the state dict. Keyed by
        # the buffers' versions so a load_state_dict (in-place copy) rebuilds it.
        self._cpu_layout: tuple[tuple[int, ...], torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128) -> Int4Linear:
        w = linear.weight
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, group_size, w.dtype, w.device)
        q = schemes.quantize_int4(w, group_size)
        module.qweight.copy_(q.qweight)
        module.scales.copy_(q.scales)
        module.zeros.copy_(q.zeros)
        if linear.bias is not None:
            module.bias.copy_(linear.bias.detach())
        return module

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = schemes.Int4Weight(self.qweight, self.scales, self.zeros, self.group_size)
        return schemes.dequantize_int4(q, dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"

    def _cuda_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        from goodserve.quant.triton_kernels import int4_matmul

        return int4_matmul(rows, self.qweight, self.scales, self.zeros, self.group_size)

    def _cpu_packed_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self.out_features % INT4_CPU_N_MULTIPLE:
            return F.linear(rows, self.dequantize(rows.dtype))
        packed, scales_and_zeros = self._cpu_kernel_layout()
        return torch._weight_int4pack_mm_for_cpu(rows.contiguous(), packed, self.group_size,
                                                 scales_and_zeros.to(rows.dtype))

    def _cpu_kernel_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        key = (self.qweight._version, self.scales._version, self.zeros._version, self.qweight.data_ptr())
        if self._cpu_layout is None or self._cpu_layout[0] != key:
            codes = schemes.unpack_int4(self.qweight).to(torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            zero8 = self.zeros + INT4_CPU_CODE_OFFSET * self.scales
            scales_and_zeros = torch.stack([self.scales, zero8], dim=-1).transpose(0, 1).contiguous()
            self._cpu_layout = (key, packed, scales_and_zeros)
        return self._cpu_layout[1], self._cpu_layout[2]
