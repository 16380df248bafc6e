"""Hugging Face checkpoints stored in FP8 (config.json's quantization_config, quant_method "fp8"), as
Qwen3-8B-FP8 or DeepSeek ship them: each linear weight is float8_e4m3fn beside its scales, either
`weight_scale_inv` per block of weight_block_size (e.g. [128, 128]: w = q * s[n // 128, k // 128])
or `weight_scale` per tensor or per output channel (w = q * s). An `input_scale` (static activation
scales) is dropped: activations are scaled per token at run time.

The weights are dequantized to the model dtype as they load; `--quantization fp8` then quantizes
them again per output channel, the scheme the FP8 GEMM takes (quant/fp8_linear.py), so a block-scaled
checkpoint is rounded twice. Checkpoints of other quantization methods (GPTQ, AWQ, compressed-tensors,
bitsandbytes) are refused: their codes would load as garbage.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from goodserve.errors import ModelLoadError

FP8_METHOD = "fp8"
BLOCK_SCALE, SCALE, INPUT_SCALE = "weight_scale_inv", "weight_scale", "input_scale"
SCALE_SUFFIXES = (BLOCK_SCALE, SCALE, INPUT_SCALE)


@dataclass(frozen=True)
class Fp8Checkpoint:
    block_size: tuple[int, int] | None  # weight_scale_inv's block (rows, columns); None: per tensor / channel
    scale_files: dict[str, Path]  # scale tensor name -> the file holding it (a shard may hold another's)

    def is_scale(self, name: str) -> bool:
        return name.rsplit(".", 1)[-1] in SCALE_SUFFIXES

    def dequantize(self, name: str, codes: torch.Tensor) -> torch.Tensor:
        """A weight as float: an fp8 one times its scales (float32), any other as it is."""
        if codes.dtype != torch.float8_e4m3fn:
            return codes
        module = name.removesuffix(".weight")
        if f"{module}.{BLOCK_SCALE}" in self.scale_files:
            scales = self._scale(f"{module}.{BLOCK_SCALE}")
            if self.block_size is None:
                raise ModelLoadError(f"{name} has block scales but config.json's quantization_config gives no "
                                     "weight_block_size")
            rows, cols = self.block_size
            scales = scales.repeat_interleave(rows, 0)[: codes.shape[0]].repeat_interleave(cols, 1)[:, : codes.shape[1]]
        elif f"{module}.{SCALE}" in self.scale_files:
            scales = self._scale(f"{module}.{SCALE}").reshape(-1, 1)  # one per tensor, or per output row
        else:
            raise ModelLoadError(f"FP8 checkpoint tensor {name} has no {BLOCK_SCALE} or {SCALE} beside it")
        return codes.float() * scales.float()

    def _scale(self, name: str) -> torch.Tensor:
        with safe_open(self.scale_files[name], framework="pt") as f:
            return f.get_tensor(name)


def fp8_checkpoint(config: dict[str, Any], files: list[Path]) -> Fp8Checkpoint | None:
    """The checkpoint's FP8 layout, None for an unquantized one; refuses other quantization methods."""
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method")
    if method != FP8_METHOD:
        raise ModelLoadError(f"this checkpoint is quantized with {method!r}, which goodserve does not load; use the "
                             "unquantized checkpoint (with --quantization int8 / int4 / fp8 to quantize it at load) "
                             "or an FP8 checkpoint (quant_method 'fp8')")
    block = quantization.get("weight_block_size")
    scale_files = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            scale_files.update({name: file for name in f.keys() if name.rsplit(".", 1)[-1] in SCALE_SUFFIXES})
    return Fp8Checkpoint(tuple(block) if block else None, scale_files)
