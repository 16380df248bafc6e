"""Programmatic dependent launch (PDL, sm_90 and later) for every Triton kernel goodserve launches.

A batch-1 decode step of an 8B model is a chain of ~300 kernels of 2-80 us each; between two of
them the GPU drains the first and launches and ramps up the second. Launched with PDL, a kernel
may be scheduled once every program of the kernel before it has started, and it runs
`griddepcontrol.wait` (which returns when that kernel has finished and its writes are visible)
before its first load or store: the launch latency hides under the previous kernel's tail, and
the order of memory effects stays exactly the stream order. The wait is chained, so a kernel
also sees the effects of every kernel before that one (each of them waited for its own
predecessor before finishing).

Kernels take `USE_PDL` and call `pdl_sync(USE_PDL)` before touching memory; launch sites pass
`**pdl_launch(pdl)`, pdl their caller's KernelChoice.pdl (ops/kernel_choice.py), which is off on
the CPU (the interpreter has no grid dependencies), on GPUs older than sm_90, and where
KernelOptions.pdl is False (the benchmarks measure both). Kernels called directly launch without.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.cache
def device_supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9 and hasattr(tl.extra.cuda, "gdc_wait")


def pdl_launch(pdl: bool) -> dict:
    """The launch keywords of a kernel launched with PDL or without."""
    return {"USE_PDL": pdl, "launch_pdl": pdl}


@triton.jit
def pdl_sync(USE_PDL: tl.constexpr):
    """Wait for the previous kernel's writes, then let the next kernel be scheduled."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
