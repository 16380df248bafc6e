"""The native Q8_0 GEMV (q8_gemv.cpp): float32 rows times int8 codes with one scale per 32 inputs
(llama.cpp's Q8_0, the GGUF models' tied lm_head), float32 out: the dequantized weight's product.

Its layout (tiles of 4 rows, each block's scales and codes side by side: one sequential stream per
tile) is built once from the codes by `Q8Layout.from_codes` and cached by the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from goodserve.native.build import library
from goodserve.native.operands import operand

BLOCK = 32  # inputs per scale
ROWS = 4  # weight rows per tile


def supports(in_features: int) -> bool:
    return in_features % BLOCK == 0 and library() is not None


@dataclass
class Q8Layout:
    tiles: torch.Tensor  # uint8 [N / 4, K / 32, 4 * 4 + 4 * 32]
    out_features: int
    in_features: int

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor) -> Q8Layout:
        """codes: int8 [N, K]; scales: [N, K / 32], one per block of 32 inputs."""
        n, k = codes.shape
        pad = -n % ROWS  # zero rows: their outputs are never written
        blocks = F.pad(codes, (0, 0, 0, pad)).view(-1, ROWS, k // BLOCK, BLOCK).transpose(1, 2)  # [tiles, blocks, 4, 32]
        block_scales = F.pad(scales.float(), (0, 0, 0, pad)).view(-1, ROWS, k // BLOCK).transpose(1, 2)
        tiles = torch.cat([block_scales.contiguous().view(torch.uint8), blocks.flatten(2).view(torch.uint8)], dim=2)
        return cls(tiles.contiguous(), n, k)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, K] float32 on the CPU (rows may be strided) -> [M, N] float32."""
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        operand("rows", rows, torch.float32, (None, self.in_features), rows=True)
        operand("tiles", self.tiles, torch.uint8,
                (-(-self.out_features // ROWS), self.in_features // BLOCK, ROWS * (4 + BLOCK)))
        m, n = rows.shape[0], self.out_features
        out = torch.empty(m, n, dtype=torch.float32)
        library().gs_q8_gemv(rows.data_ptr(), rows.stride(0), self.tiles.data_ptr(), out.data_ptr(), n, m, n,
                             self.in_features, torch.get_num_threads())
        return out
