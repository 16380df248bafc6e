"""The one check every native (ctypes) entry point runs on each tensor before the foreign call.

A C kernel reads whatever address it is given: a CUDA or meta tensor's pointer, a float where it
expects int32, or a view with gaps crashes the process or reads garbage, with no Python error.
`operand` turns all of those into a NativeOperandError first. It is on the decode hot path (a
dozen tensors a layer), so it reads only tensor metadata and costs about a microsecond.
"""

from __future__ import annotations

import torch


class NativeOperandError(ValueError):
    """A tensor a native kernel cannot read (device, dtype, layout or shape); raised before any call."""


def operand(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int | None, ...] | None = None,
            rows: bool = False) -> torch.Tensor:
    """`t` unchanged where a kernel can read it as `dtype` with `shape` (None: any size there):
    on the CPU and contiguous, or with rows=True only each index of dim 0 packed (a row stride the
    kernel takes as an argument). Otherwise a NativeOperandError naming `name`."""
    if t.device.type != "cpu":
        raise NativeOperandError(f"native kernel operand {name} is on {t.device}; it reads CPU memory only")
    if t.dtype != dtype:
        raise NativeOperandError(f"native kernel operand {name} is {t.dtype}, expected {dtype}")
    if shape is not None and (t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape))):
        wanted = tuple("*" if s is None else s for s in shape)
        raise NativeOperandError(f"native kernel operand {name} has shape {tuple(t.shape)}, expected {wanted}")
    if not (_rows_packed(t) if rows else t.is_contiguous()):
        raise NativeOperandError(f"native kernel operand {name} (strides {t.stride()}) is not "
                                 f"{'packed within its rows' if rows else 'contiguous'}")
    return t


def _rows_packed(t: torch.Tensor) -> bool:
    """Every dim but the first laid out densely, so t[i] is one packed block starting i * stride(0) in."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return t.dim() == 0 or t.shape[0] <= 1 or t.stride(0) >= expected
