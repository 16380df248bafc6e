"""Weight-only quantized linear layers: drop-in nn.Linear replacements holding int8 / int4 codes.

forward(x) equals nn.Linear on the dequantized weight. Paths:
- CUDA, int4 with bfloat16 activations and up to KernelOptions.int4_tinygemm_max_m rows (config.py):
  torch's tinygemm kernel (_weight_int4pack_mm, as gpt-fast and torchao use it), on a copy of the
  codes repacked once into its tensor-core tile layout.
- CUDA otherwise (and int4 where tinygemm is missing or fails its first-use check): the Triton
  dequantize-GEMV / GEMM kernels (quant/triton_kernels.py, ops/triton_gemv.py).
- CPU, few rows (decode): int4 takes goodserve's native kernel (native/int4_gemv.cpp: float32 rows
  and output, up to CPU_NATIVE_MAX_M rows; the GGUF layers' rows quantized to int8 blocks there,
  as llama.cpp does) where it built; otherwise, and for int8, torch's
  packed-weight kernels (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu). Both read the codes
  without materializing the weight.
- CPU, many rows (prefill), CUDA past CUDA_KERNEL_MAX_M rows, and other devices: dequantize, then a dense
  matmul; the dequantization is paid once per call and amortized over the rows, which beats the
  packed kernels there. It goes DEQUANT_CHUNK_BYTES of dequantized weight at a time, so a large
  layer (an int8 lm_head: 1 GB in bf16) needs no full-size float copy.
`matmul_path` makes the choice; the CUDA kernels among themselves, the layer's KernelChoice (`kernels`,
ops/kernel_choice.py; PDL, the int4 one-row kernel). A CUDA tensor never reaches a CPU kernel (the native ones would
read its device pointers as host memory, and they refuse it: native/operands.py).
benchmarks/cpu_quant_linear.py measured the crossover (CPU_PACKED_MAX_M); docs/quantization.md.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from goodserve.native import int4_gemv
from goodserve.ops.activation import silu_and_mul
from goodserve.ops.kernel_choice import TORCH_KERNELS, KernelChoice
from goodserve.quant import schemes

logger = logging.getLogger("goodserve.quant")

CPU_PACKED_MAX_M = 2
# The int4 CPU kernel on bfloat16 rows (Int4Linear.bf16_cpu_kernel) stays ahead of dequantizing
# far longer: at 32 rows smollm2's gate_up took 0.69 ms against 3.2 ms, and the two met near 512
# (benchmarks/results/cpu_quant_linear.json).
# Up to a decode batch's size only, so prefill chunks keep the exact float path.
CPU_BF16_KERNEL_MAX_M = 64
# The native int4 kernel (float32 rows) matched the bf16-row kernel at 64 rows on smollm2's layers
# and beat it below (benchmarks/results/cpu_quant_linear.json); same decode-batch bound.
CPU_NATIVE_MAX_M = 64
# On CUDA the fused dequantize kernels win while the weight read dominates (measured on an H100,
# benchmarks/results/gpu_quant_kernels_h100.json); for larger batches (prefill, big decode
# batches) dequantizing once and calling cuBLAS is several times faster.
CUDA_KERNEL_MAX_M = 32
DEQUANT_CHUNK_BYTES = 256 << 20  # largest dequantized weight block a many-row call holds at once
# torch's int4 kernels (CPU and CUDA tinygemm) take codes 0..15 as (q - 8) * scale + zero8, so
# zero8 = zero + 8 * scale. The CPU one needs the output dimension to be a multiple of 16.
INT4_CODE_OFFSET = 8
INT4_CPU_N_MULTIPLE = 16
# tinygemm: N a multiple of its 8-wide n tile; K a multiple of 16 * inner k tiles (8 gives 16-byte
# loads, the fastest; 4 and 2 take what 8 does not divide, e.g. smollm2's K = 576).
TINYGEMM_N_MULTIPLE = 8
TINYGEMM_INNER_K_TILES = (8, 4, 2)
TINYGEMM_GROUP_SIZES = (32, 64, 128, 256)
# First-use check of the repacked weight against our own dequantization: a right layout differs
# by bfloat16 rounding (~0.3%), a wrong one (nibble order, zero point) by tens of percent.
TINYGEMM_CHECK_ROWS = 64
TINYGEMM_CHECK_MAX_REL_ERROR = 0.03


def matmul_path(device_type: str, rows: int, cpu_packed_max_m: int) -> str:
    """Which path a call of `rows` rows on `device_type` takes: "cuda" (the CUDA kernels), "cpu_packed"
    (the CPU kernels, which read host memory: only ever for CPU tensors) or "dequantized" (torch ops,
    any device)."""
    if device_type == "cuda":
        return "cuda" if rows <= CUDA_KERNEL_MAX_M else "dequantized"
    if device_type == "cpu" and rows <= cpu_packed_max_m:
        return "cpu_packed"
    return "dequantized"


class _QuantizedLinear(nn.Module):
    """Shared shape, bias and dispatch; subclasses hold the codes and know their three paths."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None
        self.kernels = TORCH_KERNELS  # the model's, once the engine has chosen (ops/kernel_choice.use_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        on_cpu = x.device.type == "cpu"
        path = matmul_path(x.device.type, rows.shape[0], self.cpu_packed_max_m if on_cpu else 0)
        if path == "cuda":
            y = self._cuda_matmul(rows)
        elif path == "cpu_packed":
            y = self._cpu_packed_matmul(rows)
        else:
            y = self._dequantized_matmul(rows)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    @property
    def cpu_packed_max_m(self) -> int:
        """The most rows a CPU call sends to the packed kernel rather than dequantizing."""
        return CPU_PACKED_MAX_M

    def _dequantized_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        chunk = max(1, DEQUANT_CHUNK_BYTES // (self.in_features * rows.element_size()))
        if chunk >= self.out_features:
            return F.linear(rows, self.dequantize(rows.dtype))
        return torch.cat([F.linear(rows, self.dequantize(rows.dtype, slice(start, start + chunk)))
                          for start in range(0, self.out_features, chunk)], dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PerChannelCodes:
    """from_linear for layers holding `qweight` codes and one float32 scale per output channel
    (int8, fp8): quantize_weight is the scheme's function, (weight, row_absmax) -> codes and scales."""

    quantize_weight = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, row_absmax: torch.Tensor | None = None):
        w = linear.weight
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype, w.device)
        q = cls.quantize_weight(w, row_absmax)
        module.qweight.copy_(q.qweight)
        module.scales.copy_(q.scales)
        if linear.bias is not None:
            module.bias.copy_(linear.bias.detach())
        return module


class Int8Linear(PerChannelCodes, _QuantizedLinear):
    quantize_weight = staticmethod(schemes.quantize_int8)

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__(in_features, out_features, bias, dtype, device)
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.float32, device=device))

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: slice = slice(None)) -> torch.Tensor:
        return schemes.dequantize_int8(schemes.Int8Weight(self.qweight[rows], self.scales[rows]), dtype)

    def _cuda_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        from goodserve.quant.triton_kernels import int8_matmul

        return int8_matmul(rows, self.qweight, self.scales, self.kernels.pdl)

    def _cpu_packed_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(rows.contiguous(), self.qweight, self.scales.to(rows.dtype))


def int4_scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Our [N, G] scales and zeros (w = q * s + z) -> torch's int4 kernels' [G, N, 2] (s, z + 8 s)."""
    zero8 = zeros + INT4_CODE_OFFSET * scales
    return torch.stack([scales, zero8], dim=-1).transpose(0, 1).contiguous()


def tinygemm_nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """Our packed codes (even column in the low nibble) -> the byte order the CUDA packer takes
    (_convert_weight_to_int4pack with uint8 input, torch >= 2.5: even column in the high nibble)."""
    return ((qweight & 0xF) << 4) | (qweight >> 4)


def tinygemm_inner_k_tiles(in_features: int, out_features: int, group_size: int) -> int | None:
    """The inner k-tile count tinygemm can pack this shape with, or None where it cannot."""
    if out_features % TINYGEMM_N_MULTIPLE or group_size not in TINYGEMM_GROUP_SIZES:
        return None
    return next((t for t in TINYGEMM_INNER_K_TILES if in_features % (16 * t) == 0), None)


def tinygemm_layout(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed int32 tiles, bf16 [G, N, 2] scales and zeros) for _weight_int4pack_mm; CUDA only."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    inner_k_tiles = tinygemm_inner_k_tiles(k, n, group_size)
    if inner_k_tiles is None:
        raise ValueError(f"tinygemm cannot take N={n}, K={k}, group size {group_size}")
    packed = torch.ops.aten._convert_weight_to_int4pack(tinygemm_nibbles(qweight).contiguous(), inner_k_tiles)
    return packed, int4_scales_and_zeros(scales, zeros).to(torch.bfloat16)


@functools.lru_cache(maxsize=None)
def warn_once(message: str) -> None:
    logger.warning(message)


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
        # The kernels' own weight layouts, built on first use and not part of the state dict (a
        # checkpoint keeps our codes). Keyed by the buffers' versions and addresses, so a
        # load_state_dict (in-place copy) or a move to another device rebuilds them.
        self._cpu_layout: tuple[tuple, torch.Tensor, torch.Tensor] | None = None
        self._native_layout: tuple[tuple, int4_gemv.Int4Layout] | None = None
        self._native_supported: bool | None = None  # whether the native kernel takes this shape, once known
        self._tinygemm: tuple[tuple[int, ...], torch.Tensor, torch.Tensor] | None = None
        self.tinygemm_disabled = False  # set for good once tinygemm fails here; Triton serves instead
        self._rows_layout: tuple[tuple[int, ...], object] | None = None  # "rows_repacked"'s copy
        # CPU decode: run torch's packed kernel on bfloat16-rounded rows whatever the activation
        # dtype. Its float32 / float16 variants are scalar loops (~20x slower on an AVX-512 EPYC,
        # docs/quantization.md); the GGUF layers (quant/gguf_native.py) turn this on.
        self.bf16_cpu_kernel = False
        # CPU decode on the native kernel: quantize activation rows to int8 per block of 32 and take
        # integer dot products, as llama.cpp does (native/int4_gemv.py); the GGUF layers turn it on.
        # Off: float32 rows, the exact dequantized product.
        self.int8_activations = False

    @property
    def kernels(self) -> KernelChoice:
        return self._kernels

    @kernels.setter
    def kernels(self, kernels: KernelChoice) -> None:
        """What CUDA calls take follows from the choice, settled here rather than on every call: the
        one-row kernel, the rows kernel's launch, and the row counts tinygemm takes (bf16 only)."""
        self._kernels = kernels
        self.one_row_kernel = kernels.int4_one_row_kernel(self.out_features, self.in_features)
        self.rows_overrides = kernels.options.int4_rows_configs.get((self.out_features, self.in_features), {})
        self.tinygemm_rows = (1 if self.one_row_kernel == "tinygemm" else 2, kernels.options.int4_tinygemm_max_m)
        # silu_and_mul's one-row calls on a paired rows_repacked copy (see silu_and_mul)
        self.fuses_silu = (kernels.options.int4_fused_silu_and_mul and self.one_row_kernel == "rows_repacked"
                           and self.out_features % 2 == 0)

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

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: slice = slice(None)) -> torch.Tensor:
        q = schemes.Int4Weight(self.qweight[rows], self.scales[rows], self.zeros[rows], self.group_size)
        return schemes.dequantize_int4(q, dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"

    def _codes_key(self) -> tuple[int, ...]:
        # Checked on every decode call, so the buffers come straight from their dict (nn.Module's
        # attribute lookup costs ~0.7 us each).
        tensors = qweight, scales, zeros = tuple(self._buffers[name] for name in ("qweight", "scales", "zeros"))
        addresses = (qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr())
        if qweight.is_inference():  # inference-mode tensors keep no version counter; addresses still tell
            return addresses
        return addresses + tuple(t._version for t in tensors)

    def int8_rows_on_cpu(self, rows: torch.Tensor) -> bool:
        """Whether this layer's CPU decode calls quantize their rows (int8_activations where the
        kernel has that path): then its many-row calls quantize theirs too, so a row's result does
        not depend on its batch's size."""
        return self.int8_activations and rows.device.type == "cpu" and int4_gemv.int8_dot_available()

    def _dequantized_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self.int8_rows_on_cpu(rows):
            rows = int4_gemv.quantize_activation_blocks(rows.float()).to(rows.dtype)
        return super()._dequantized_matmul(rows)

    def _cuda_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        pdl = self._kernels.pdl
        if rows.shape[0] == 1 and self.one_row_kernel.startswith("rows"):
            from goodserve.ops.triton_gemv import int4_rows_gemv

            if self.one_row_kernel == "rows_repacked" and (layout := self._rows_repacked()) is not None:
                return int4_rows_gemv(rows, layout, pdl=pdl, **self.rows_overrides)
            return int4_rows_gemv(rows, self.qweight, self.scales, self.zeros, self.group_size, pdl=pdl,
                                  **self.rows_overrides)
        fewest, most = self.tinygemm_rows
        if rows.dtype == torch.bfloat16 and fewest <= rows.shape[0] <= most:
            layout = self._tinygemm_layout()
            if layout is not None:
                try:
                    return torch.ops.aten._weight_int4pack_mm(rows.contiguous(), layout[0], self.group_size, layout[1])
                except RuntimeError as exc:
                    self._disable_tinygemm(exc)
        from goodserve.quant.triton_kernels import int4_matmul

        return int4_matmul(rows, self.qweight, self.scales, self.zeros, self.group_size, pdl)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """ops/activation.silu_and_mul(self(x)), for a layer whose outputs are [gate | up] (gate_up_proj).
        One CUDA row with a paired copy (KernelOptions.int4_fused_silu_and_mul) takes one kernel, the
        GEMV finishing SwiGLU itself; every other call, the projection and then the activation."""
        if self.fuses_silu and x.is_cuda and x.numel() == self.in_features and self.bias is None:
            layout = self._rows_repacked(paired=True)
            if layout is not None:
                from goodserve.ops.triton_gemv import int4_rows_gemv

                y = int4_rows_gemv(x.reshape(1, -1), layout, pdl=self._kernels.pdl, gated=True, **self.rows_overrides)
                return y.reshape(*x.shape[:-1], self.out_features // 2)
        return silu_and_mul(self(x), self._kernels)

    def _rows_repacked(self, paired: bool = False):
        """The rows kernel's repacked copy (built on first use, outside graph capture), or None.
        paired: one with rows j and N/2 + j side by side (silu_and_mul's); plain calls take either,
        so a layer keeps one copy."""
        key = self._codes_key()
        held = self._rows_layout
        if held is not None and held[0] == key and (held[1].paired or not paired):
            return held[1]
        if self.qweight.is_cuda and torch.cuda.is_current_stream_capturing():
            return None  # the runner's warm-up calls build it; meanwhile the checkpoint layout serves
        from goodserve.ops.triton_gemv import int4_rows_config, int4_rows_layout

        config = int4_rows_config(self.out_features, self.in_features, self.group_size, self.qweight.device,
                                  **self.rows_overrides)
        self._rows_layout = (key, int4_rows_layout(self.qweight, self.scales, self.zeros, self.group_size,
                                                   config.block_n, paired))
        return self._rows_layout[1]

    def _tinygemm_layout(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.tinygemm_disabled:
            return None
        key = self._codes_key()
        if self._tinygemm is not None and self._tinygemm[0] == key:
            return self._tinygemm[1], self._tinygemm[2]
        if self.qweight.is_cuda and torch.cuda.is_current_stream_capturing():
            return None  # repacking and checking need eager mode; the runner's warm-up calls build it
        try:
            packed, scales_and_zeros = tinygemm_layout(self.qweight, self.scales, self.zeros, self.group_size)
            self._check_tinygemm(packed, scales_and_zeros)
        except Exception as exc:  # op missing in this build, shape it refuses, or a failed check
            self._disable_tinygemm(exc)
            return None
        self._tinygemm = (key, packed, scales_and_zeros)
        return packed, scales_and_zeros

    def _check_tinygemm(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> None:
        """One-hot rows pick weight columns out of tinygemm; they must match our dequantization."""
        k = self.in_features
        cols = torch.linspace(0, k - 1, min(k, TINYGEMM_CHECK_ROWS), device=self.qweight.device).round().long()
        probe = torch.zeros(len(cols), k, dtype=torch.bfloat16, device=self.qweight.device)
        probe[torch.arange(len(cols), device=probe.device), cols] = 1
        got = torch.ops.aten._weight_int4pack_mm(probe, packed, self.group_size, scales_and_zeros).float()
        byte = self.qweight[:, cols // 2]
        codes = torch.where(cols % 2 == 0, byte & 0xF, byte >> 4).float()
        groups = cols // self.group_size
        want = (codes * self.scales[:, groups] + self.zeros[:, groups]).T
        error = ((got - want).norm() / want.norm().clamp(min=1e-12)).item()
        if not error <= TINYGEMM_CHECK_MAX_REL_ERROR:
            raise RuntimeError(f"tinygemm's repacked weight is off by {error:.3g} relative to our codes")

    def _disable_tinygemm(self, exc: Exception) -> None:
        self.tinygemm_disabled = True
        self._tinygemm = None
        warn_once(f"int4 tinygemm kernel unavailable ({type(exc).__name__}: {exc}); "
                   "using the Triton int4 kernels instead")

    @property
    def cpu_packed_max_m(self) -> int:
        if self._native_kernel():
            return CPU_NATIVE_MAX_M
        return CPU_BF16_KERNEL_MAX_M if self.bf16_cpu_kernel else CPU_PACKED_MAX_M

    def _native_kernel(self) -> bool:
        """Whether CPU calls take the native kernel (asked on every decode call, so kept)."""
        if self._native_supported is None:
            self._native_supported = int4_gemv.supports(self.in_features, self.group_size)
        return self._native_supported

    def _cpu_packed_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self._native_kernel():  # float32 in and out, whatever the activation dtype
            return self._native_kernel_layout().matmul(rows.float()).to(rows.dtype)
        if self.out_features % INT4_CPU_N_MULTIPLE:
            return self._dequantized_matmul(rows)
        dtype = torch.bfloat16 if self.bf16_cpu_kernel else rows.dtype
        packed, scales_and_zeros = self._cpu_kernel_layout(dtype)
        y = torch._weight_int4pack_mm_for_cpu(rows.to(dtype).contiguous(), packed, self.group_size, scales_and_zeros)
        return y.to(rows.dtype)

    def native_layout(self) -> int4_gemv.Int4Layout | None:
        """The native kernel's layout of these codes (for a fused native decoder layer), or None where
        CPU calls do not take the native kernel."""
        return self._native_kernel_layout() if self._native_kernel() else None

    def _native_kernel_layout(self) -> int4_gemv.Int4Layout:
        key = self._codes_key()
        if self._native_layout is None or self._native_layout[0] != key:
            layout = int4_gemv.Int4Layout.from_codes(self.qweight, self.scales, self.zeros, self.group_size)
            self._native_layout = (key, layout)
        layout = self._native_layout[1]
        layout.int8_activations = self.int8_activations and int4_gemv.int8_dot_available()
        return layout

    def _cpu_kernel_layout(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's packed codes and its [G, N, 2] scales and zeros, in the activation dtype it
        takes them in (converted once, not per call: for a large layer that costs milliseconds)."""
        key = (*self._codes_key(), dtype)
        if self._cpu_layout is None or self._cpu_layout[0] != key:
            codes = schemes.unpack_int4(self.qweight).to(torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            self._cpu_layout = (key, packed, int4_scales_and_zeros(self.scales, self.zeros).to(dtype))
        return self._cpu_layout[1], self._cpu_layout[2]
