"""The native int4 GEMV (int4_gemv.cpp): float32 rows times Int4Linear's codes, float32 out.

With `int8_activations` the kernel first quantizes each row to int8 per block of 32 and takes
integer dot products with the codes, as llama.cpp does for its formats (int4_gemv.cpp; the GGUF
layers use it where `int8_dot_available()`); `int8_activation_matmul_reference` is that
arithmetic in plain torch.

Its layout (tiles of 4 rows, each group's scales, zeros and codes side by side: one sequential
stream per tile) is built once per layer from the canonical codes by `Int4Layout.from_codes` and
cached by the layer, like torch's kernel layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import functools

import torch
import torch.nn.functional as F

from goodserve.native.build import library
from goodserve.native.operands import NativeOperandError, operand

GROUP_SIZES = (32, 64, 128)  # the kernel unrolls each
ROWS = 4  # weight rows per tile


def supports(in_features: int, group_size: int) -> bool:
    return group_size in GROUP_SIZES and in_features % group_size == 0 and library() is not None


@functools.cache
def int8_dot_available() -> bool:
    """Whether this build has the int8-activation path (AVX-512BW or AVX2; VNNI where the CPU has it)."""
    return library() is not None and bool(library().gs_int8_dot_available())


def quantize_activation_blocks(rows: torch.Tensor) -> torch.Tensor:
    """[..., K] float32 rows as the int8-activation kernel sees them: per block of 32,
    d = max |x| / 127, q = round(x / d) (to nearest even), and the row becomes d * q. The many-row
    calls of those layers multiply this, so every path computes the same product."""
    blocks = rows.reshape(*rows.shape[:-1], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127)).reshape(rows.shape)


def int8_activation_matmul_reference(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the int8-activation kernel computes, in float64 torch: the quantized rows times the
    dequantized weight [N, K]."""
    return (quantize_activation_blocks(rows.float()).double() @ weight.double().T).float()


@functools.cache
def half_scales_available() -> bool:
    """Whether this build reads float16 scales and zeros (F16C)."""
    return library() is not None and bool(library().gs_half_scales_available())


def tile_group_bytes(group_size: int, half_scales: bool = False) -> int:
    """One tile's bytes for one group: 4 scales and 4 zeros (float16 or float32), then 4 rows of codes."""
    return 2 * ROWS * (2 if half_scales else 4) + ROWS * group_size // 2


def chunk_nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """Our packed codes (byte j: column 2j low, 2j + 1 high) -> [N, K / 32, 16] chunks in which
    byte j holds column j low and column j + 16 high."""
    low, high = qweight & 0xF, qweight >> 4
    codes = torch.stack([low, high], dim=-1).view(qweight.shape[0], -1, 2, 16)  # [N, chunks, half, 16]
    return codes[:, :, 0] | (codes[:, :, 1] << 4)


@dataclass
class Int4Layout:
    tiles: torch.Tensor  # uint8 [N / 4, groups, 32 + chunks per group * 64]
    out_features: int
    in_features: int
    group_size: int
    int8_activations: bool = False  # set by the owning layer (Int4Linear.int8_activations)
    half_scales: bool = False  # float16 scales and zeros (exact for GGUF's): a sixth fewer bytes at group 32

    @classmethod
    def from_codes(cls, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   group_size: int) -> Int4Layout:
        """Scales and zeros go in float16 where every one of them is a float16 and the build reads
        them (GGUF's are), else in float32."""
        n, groups = scales.shape
        half = half_scales_available() and all(torch.equal(t.float().half().float(), t.float()) for t in (scales, zeros))
        pad = -n % ROWS  # zero rows: their outputs are never written
        chunks = F.pad(chunk_nibbles(qweight), (0, 0, 0, 0, 0, pad))
        codes = chunks.view(-1, ROWS, groups, group_size // 32, 16).permute(0, 2, 3, 1, 4).flatten(2)
        scales_zeros = torch.stack([F.pad(t.float(), (0, 0, 0, pad)).view(-1, ROWS, groups).transpose(1, 2)
                                    for t in (scales, zeros)], dim=2)  # [tiles, groups, 2, 4]
        scales_zeros = scales_zeros.half() if half else scales_zeros
        tiles = torch.cat([scales_zeros.flatten(2).view(torch.uint8), codes], dim=2).contiguous()
        return cls(tiles, n, qweight.shape[1] * 2, group_size, half_scales=half)

    def check(self, name: str = "tiles", in_features: int | None = None, out_features: int | None = None) -> None:
        """The tiles are what the kernel reads for this shape (and for the given one, if any)."""
        if (in_features, out_features) not in ((None, None), (self.in_features, self.out_features)):
            raise NativeOperandError(f"{name} is {self.out_features} x {self.in_features}, expected "
                                     f"{out_features} x {in_features}")
        operand(name, self.tiles, torch.uint8, (-(-self.out_features // ROWS), self.in_features // self.group_size,
                                                tile_group_bytes(self.group_size, self.half_scales)))

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, K] float32 on the CPU (rows may be strided) -> [M, N] float32."""
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        operand("rows", rows, torch.float32, (None, self.in_features), rows=True)
        self.check()
        m, n = rows.shape[0], self.out_features
        out = torch.empty(m, n, dtype=torch.float32)
        status = library().gs_int4_gemv(rows.data_ptr(), rows.stride(0), self.tiles.data_ptr(), out.data_ptr(), n,
                                        m, n, self.in_features, self.group_size, torch.get_num_threads(),
                                        int(self.int8_activations), int(self.half_scales))
        if status:
            raise ValueError({-1: f"the native int4 kernel does not take group size {self.group_size}",
                              -2: "this build of the native int4 kernel has no int8-activation path",
                              -3: "this build of the native int4 kernel reads no float16 scales"}[status])
        return out
