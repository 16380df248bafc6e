"""FP8 linear layers (--quantization fp8): a drop-in nn.Linear whose matmul runs on FP8 tensor cores.

The weight is float8_e4m3fn with one float32 scale per output channel (quant/schemes.quantize_fp8,
computed once at load). Each call quantizes its activation rows the same way, one scale per token
(row amax / 448, computed on the device: no host sync, so CUDA graphs capture it), and multiplies
the two in one torch._scaled_mm (cuBLASLt's FP8 GEMM with row-wise scales):

    y[m, n] = scale_x[m] * scale_w[n] * sum_k q_x[m, k] * q_w[n, k]   (+ bias)

Against bf16 that is half the weight bytes a decode step reads and twice the tensor FLOP/s a
prefill or a large batch gets; unlike int8 / int4 (weight-only, dequantized past 32 rows a call on
CUDA) it stays an FP8 GEMM at every batch size.

Where it runs: CUDA GPUs of compute capability 8.9+ (Ada, Hopper), refused on older ones when the
layer is built. The CPU runs torch's reference _scaled_mm, exact but about 100x slower than float32
(a 1 x 576 x 3072 call: 11 ms against 0.11): for tests, and for `goodserve eval` to measure fp8's
quality on any machine, not for serving. cuBLASLt takes K and N in multiples of 16; a layer of
another shape is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from goodserve.errors import InvalidRequestError
from goodserve.quant import schemes
from goodserve.quant.linear import PerChannelCodes, warn_once

FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) on
FP8_DIM_MULTIPLE = 16  # torch._scaled_mm (cuBLASLt): K and N multiples of 16
# The row-wise-scaled FP8 GEMM writes bfloat16 on every CUDA build (float16 and float32 only on some):
# a float16 or float32 model's rows come back through bfloat16.
GEMM_OUT_DTYPE = torch.bfloat16


def check_fp8_capability(capability: tuple[int, int], device_name: str = "this GPU") -> None:
    if tuple(capability) < FP8_MIN_CAPABILITY:
        major, minor = FP8_MIN_CAPABILITY
        raise InvalidRequestError(
            f"quantization 'fp8' needs FP8 tensor cores: a GPU of compute capability {major}.{minor} or higher "
            f"(Ada, Hopper); {device_name} has {capability[0]}.{capability[1]}. Use --quantization int8 or int4 there")


def check_fp8_device(device: torch.device | str) -> None:
    """Refuses a device fp8 layers cannot run on; on the CPU says (once) that it is for testing."""
    device = torch.device(device)
    if device.type == "cuda":
        check_fp8_capability(torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device))
    elif device.type == "cpu":
        warn_once("quantization 'fp8' on the CPU runs torch's reference FP8 matmul, about 100x slower than a "
                  "float32 one: for tests and quality checks (goodserve eval), not for serving; fp8 is meant for "
                  "GPUs of compute capability 8.9+")
    elif device.type != "meta":
        raise InvalidRequestError(f"quantization 'fp8' runs on CUDA GPUs of compute capability 8.9+ (and on the "
                                  f"CPU for testing), not on {device.type}")


def check_fp8_shape(layer: str, in_features: int, out_features: int) -> None:
    if in_features % FP8_DIM_MULTIPLE or out_features % FP8_DIM_MULTIPLE:
        raise InvalidRequestError(
            f"quantization 'fp8' needs each layer's input and output sizes in multiples of {FP8_DIM_MULTIPLE} "
            f"(the FP8 GEMM's rule); {layer} is {in_features} -> {out_features}")


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] activations -> (float8_e4m3fn [M, K], float32 scales [M, 1]), each row's amax onto 448."""
    if rows.is_cuda:
        from goodserve.quant.triton_fp8 import quantize_rows_fp8

        return quantize_rows_fp8(rows)
    return quantize_rows_torch(rows)


def quantize_rows_torch(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows in torch ops (the CPU's path, and the reference the Triton kernel is tested against)."""
    amax = torch.linalg.vector_norm(rows, ord=float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    # times the reciprocal, not divided: what torch's CUDA kernel does for a division by a number, so the
    # CPU, CUDA and the Triton kernel (which must match this bit for bit) agree
    scales = (amax * (1.0 / schemes.FP8_MAX)).clamp(min=schemes.MIN_SCALE)
    return (rows.float() / scales).clamp(-schemes.FP8_MAX, schemes.FP8_MAX).to(schemes.FP8_DTYPE), scales


class Fp8Linear(PerChannelCodes, nn.Module):
    quantize_weight = staticmethod(schemes.quantize_fp8)

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None):
        super().__init__()
        check_fp8_shape("an fp8 linear layer", in_features, out_features)
        check_fp8_device(device or "cpu")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=schemes.FP8_DTYPE, device=device))
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return schemes.dequantize_fp8(schemes.Fp8Weight(self.qweight, self.scales), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if not rows.shape[0]:  # the row-wise GEMM takes no empty operand
            return x.new_zeros(*x.shape[:-1], self.out_features)
        q, row_scales = quantize_rows(rows)
        out_dtype = GEMM_OUT_DTYPE if rows.is_cuda else rows.dtype
        # qweight [N, K] row-major: its transpose is the column-major [K, N] operand cuBLASLt takes.
        y = torch._scaled_mm(q, self.qweight.t(), scale_a=row_scales, scale_b=self.scales.view(1, -1),
                             out_dtype=out_dtype).to(rows.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
