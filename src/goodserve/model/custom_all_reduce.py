"""The tensor-parallel all-reduce of small CUDA tensors (decode's) without NCCL: torch's one-shot
all-reduce on symmetric memory, as vLLM's custom all-reduce does it with a kernel of its own.

One buffer per tensor-parallel group, allocated at set-up and mapped into every rank's address
space (CUDA IPC over NVLink or PCIe P2P). A call is one kernel: it copies the rank's input into its
buffer, waits for its peers' (signal pads on the device, no host, no NCCL proxy), then reads every
peer's buffer and sums. On 2 H200s that was 6.6 us against NCCL's 22.2 us in a CUDA graph for 16 KB
(benchmarks/results/gpu_allreduce_h200x2.json, from benchmarks/gpu_allreduce.py). Each rank reads each peer's whole message,
so only messages up to the buffer's size (KernelOptions.custom_all_reduce_max_bytes) take it;
larger ones (prefill chunks) stay on NCCL.

Where the all-reduce's output goes straight into the residual add and RMSNorm (every decoder layer's
two), the group's second buffer serves the kernel that does all three (ops/all_reduce_norm.py: no
barrier, one launch instead of two).

The engine's CUDA graphs capture it like any kernel: the buffer and the peers' addresses are fixed
before any capture (the rendezvous is at set-up), and the signal pads are back at zero after each
call, so replays repeat it. NVLink multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1): the
one-shot kernel reads the peers' memory directly and never uses it.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # the kernel's module imports Triton: only where the fused kernel is set up
    from goodserve.ops.all_reduce_norm import LamportBuffers

logger = logging.getLogger("goodserve.engine")

# What torch's one-shot kernel takes: float32 and bfloat16 (its dispatch), sizes of whole 4-byte words.
_DTYPES = (torch.float32, torch.bfloat16)
_MIN_ALIGNMENT = 4
# The kernel's own copy of the input needs the input as aligned as the buffer's start (16 bytes).
_COPY_ALIGNMENT = 16


class CustomAllReduce:
    def __init__(self, buffer: torch.Tensor, group_name: str, lamport: LamportBuffers | None = None) -> None:
        self.buffer = buffer  # uint8, symmetric: every rank's is mapped into the others'
        self.group_name = group_name
        self.fused_copy = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")
        self.lamport = lamport  # the buffers of the all-reduce fused with add + RMSNorm, where set up

    def takes(self, x: torch.Tensor) -> bool:
        """Whether x goes this way (else NCCL): small enough for the buffer, of a type the kernel sums."""
        nbytes = x.numel() * x.element_size()
        return (x.dtype in _DTYPES and x.is_contiguous() and 0 < nbytes <= self.buffer.numel()
                and nbytes % _MIN_ALIGNMENT == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the group's ranks, in a new tensor (x is left as it was)."""
        staged = self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        out = torch.empty_like(x)
        if self.fused_copy and x.storage_offset() * x.element_size() % _COPY_ALIGNMENT == 0:
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, x, "sum", self.group_name, out)
        else:
            staged.copy_(x)
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out)
        return out

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether x's all-reduce can go into the add + RMSNorm kernel after it."""
        return self.lamport is not None and self.lamport.takes(x)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        from goodserve.ops.all_reduce_norm import all_reduce_add_rms_norm

        return all_reduce_add_rms_norm(x, residual, weight, eps, self.lamport)


def set_up_custom_all_reduce(group: dist.ProcessGroup | None, device: torch.device,
                             max_bytes: int, fuse_into_norm: bool = True) -> CustomAllReduce | None:
    """The group's custom all-reduce, or None where it cannot run (NCCL / gloo then): the log says
    which and why. Every rank of the group calls it (it is a collective), and all get the same answer.
    fuse_into_norm: also the buffers of the all-reduce fused with the residual add and RMSNorm."""
    group = group or dist.group.WORLD
    custom, why_not = None, _why_not(group, device, max_bytes)
    if why_not is None:
        try:
            custom = _rendezvous(group, device, max_bytes, fuse_into_norm)
        except Exception as exc:  # noqa: BLE001 - any failure leaves NCCL in charge
            why_not = f"set-up failed ({type(exc).__name__}: {exc})"
    if device.type == "cuda" and not _every_rank(custom is not None, group, device):
        custom, why_not = None, why_not or "another rank could not set it up"
    if custom is None:
        logger.log(logging.WARNING if device.type == "cuda" and max_bytes else logging.INFO,
                   "tensor-parallel all-reduce: %s (no custom all-reduce: %s)",
                   "NCCL" if device.type == "cuda" else "gloo", why_not)
    else:
        logger.info("tensor-parallel all-reduce: one-shot on symmetric memory up to %d bytes, NCCL above%s",
                    max_bytes, "; fused with add + RMSNorm" if custom.lamport is not None else "")
    return custom


def _why_not(group: dist.ProcessGroup, device: torch.device, max_bytes: int) -> str | None:
    """Why the custom all-reduce cannot run here, or None. Every rank finds the same: the local
    checks hold or fail alike on all (same config, same torch), and then they compare hosts together."""
    if device.type != "cuda":
        return "tensors on the CPU"
    if max_bytes == 0:
        return "custom_all_reduce_max_bytes is 0"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
        return f"torch {torch.__version__} has no one-shot all-reduce on symmetric memory"
    places = [None] * group.size()
    dist.all_gather_object(places, (socket.gethostname(), device.index), group=group)
    if len({host for host, _ in places}) > 1:
        return "the ranks are on more than one host"
    if not all(torch.cuda.can_device_access_peer(device.index, peer) for _, peer in places if peer != device.index):
        return "no P2P access between the GPUs"
    return None


def _rendezvous(group: dist.ProcessGroup, device: torch.device, max_bytes: int,
                fuse_into_norm: bool) -> CustomAllReduce:
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # read at the first allocation
    import torch.distributed._symmetric_memory as symm_mem

    name = group.group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None and not getattr(enable, "__deprecated__", None):  # older torch: a group needs it first
        enable(name)
    buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
    symm_mem.rendezvous(buffer, name)
    return CustomAllReduce(buffer, name, _lamport_buffers(group, device, max_bytes) if fuse_into_norm else None)


def _lamport_buffers(group: dist.ProcessGroup, device: torch.device, slot_bytes: int) -> LamportBuffers:
    """2 parities x world slots a rank, all marks, every rank's filled before any rank may write."""
    import torch.distributed._symmetric_memory as symm_mem

    from goodserve.ops.all_reduce_norm import LamportBuffers, fill_with_marks

    world = group.size()
    buffer = symm_mem.empty(2 * world * slot_bytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buffer, group.group_name)
    fill_with_marks(buffer)
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    addresses = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
    # A row's parity; a call has at most slot_bytes / (2 x hidden) rows, and hidden >= 64.
    parity = torch.zeros(slot_bytes // 128, dtype=torch.int32, device=device)
    return LamportBuffers(buffer, addresses, parity, group.rank(), world, slot_bytes)


def _every_rank(ok: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ok holds on every rank: a rank alone on NCCL would leave its peers waiting in the kernel."""
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
