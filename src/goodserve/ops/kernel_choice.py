"""Which kernels one model's ops launch: chosen once, when the model is built, and held by its modules.

Every op that has a Triton kernel (attention and the RoPE + cache write, the norms, the activation,
argmax, the GEMV-routed and quantized linears) takes a KernelChoice from its caller, or reads its
module's `kernels`, and never any process-wide setting: two engines built with different choices
in one process each keep their own. A check of a bool attribute is all the hot path pays.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import torch
from torch import nn

from goodserve.config import ATTENTION_BACKENDS, KernelOptions


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    triton: bool = False  # the Triton kernels; else torch (and on the CPU the native kernels)
    pdl: bool = False  # Triton launches with programmatic dependent launch (ops/pdl.py)
    options: KernelOptions = KernelOptions()  # the rest, as the engine was given them

    def int4_one_row_kernel(self, out_features: int, in_features: int) -> str:
        """The one-row kernel of an int4 layer of this shape (config.INT4_ONE_ROW_KERNELS)."""
        return self.options.int4_one_row_kernel_by_shape.get((out_features, in_features),
                                                             self.options.int4_one_row_kernel)

    def decode_attention_tuning(self, batch: int) -> dict | None:
        """Decode attention's launch overrides for `batch` sequences
        (KernelOptions.decode_attention_tuning_by_batch); None: DECODE_TUNING's."""
        table = self.options.decode_attention_tuning_by_batch
        fitting = [max_batch for max_batch in table if max_batch >= batch]
        return table[min(fitting)] if fitting else None


# The choice of a module built outside an engine (tests, tools): torch and native kernels only.
TORCH_KERNELS = KernelChoice()


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def choose_kernels(backend: str, options: KernelOptions, device: torch.device) -> KernelChoice:
    """backend "auto": Triton on a CUDA device (where triton is installed), torch elsewhere; "torch":
    never Triton; "triton": always (on the CPU only under TRITON_INTERPRET=1, as the kernel tests run).
    PDL where options ask for it and the device has it."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend == "triton" and not triton_available():
        raise RuntimeError("attention_backend='triton' needs the triton package")
    triton = backend == "triton" or (backend == "auto" and device.type == "cuda" and triton_available())
    return KernelChoice(triton=triton, pdl=options.pdl and _pdl_supported(device), options=options)


def _pdl_supported(device: torch.device) -> bool:
    if device.type != "cuda" or not triton_available():
        return False
    from goodserve.ops.pdl import device_supports_pdl

    return device_supports_pdl(device.index if device.index is not None else torch.cuda.current_device())


def use_kernels(model: nn.Module, kernels: KernelChoice) -> None:
    """Give every module of the model that launches kernels (those with a `kernels` attribute) this choice."""
    for module in model.modules():
        if hasattr(module, "kernels"):
            module.kernels = kernels
