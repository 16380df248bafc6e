"""Giving back the memory of engines a process has dropped, before the next one is sized.

Two things keep a dropped engine's bytes from the device. Reference cycles: a module imported
lazily while an engine is built can leave its import's frames in a cycle (torch._dynamo's, through
torch.fx.wrap's `inspect.currentframe()`), and those frames hold every caller's locals, the engine
and its model among them, until the collector runs. And torch's caching allocator: freed tensors'
blocks stay reserved by the process, which `torch.cuda.mem_get_info` counts as used, so a second
engine would size its KV cache around the first one's. Both are given back here.
"""

from __future__ import annotations

import gc

import torch


def release_dropped_memory() -> None:
    """Collect the garbage cycles, then hand the allocator's cached blocks back to the device."""
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
