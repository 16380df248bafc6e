"""Accelerator limits: peak dense FLOP/s per dtype, memory bandwidth and capacity.

Numbers are the vendors' datasheet peaks for dense math (no 2:4 sparsity); real kernels reach
roughly 60-80% of FLOP/s and 80-90% of bandwidth, which is why MFU/MBU near 100% never happen.
Beside each peak bandwidth, the share of it a copy reaches (`copy_bandwidth`): what a prediction
of a step's time reads at, where MBU and the roofline's ridge keep the peak. `measure_local()`
probes the machine it runs on instead (a copy and a matmul, with torch). A root module:
`diagnose/` reads it, and so does the engine (its step-time model's roofline priors).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from goodserve.errors import InvalidRequestError

TERA = 1e12
GB = 1e9
# The share of an HBM datasheet's bandwidth a copy reaches (dst.copy_(src), bytes read + written a
# second): 3.00 of 3.35 TB/s on an H100 SXM (copy_bandwidth_gbps_per_gpu 2994-2999 in
# benchmarks/results/gpu_tp_fused_h100x4.json and gpu_tp_70b_fused_h100x4.json, 3002 in
# gpu_peer_vllm_h100.json). Assumed for the table's GPUs with no copy measured (H100 PCIe, the A100s,
# and the GDDR6 L4 and A10G): the H200, the one other measured, reaches 0.88 (its entry's own).
COPY_EFFICIENCY = 3.0 / 3.35


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict[str, float]  # dtype -> FLOP/s (int8: OP/s)
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    # One GPU's link to its peers, one direction (NVLink, else PCIe), for tensor parallelism's
    # all-reduces; 0: unknown (a measured machine).
    link_bandwidth: float = 0.0
    note: str = ""
    measured: bool = field(default=False)
    copy_efficiency: float = COPY_EFFICIENCY  # of memory_bandwidth, what a copy reaches

    @property
    def copy_bandwidth(self) -> float:
        """Bytes/s a copy reaches: the rate a decode step's weight and KV reads get in practice."""
        return self.memory_bandwidth * self.copy_efficiency

    def flops_for(self, dtype: str) -> float:
        """Peak for a compute dtype; weight-only int8/int4 still multiply in bf16."""
        key = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "auto": "bf16",
               "int4": "bf16"}.get(dtype, dtype)
        if key not in self.peak_flops:
            key = "bf16" if "bf16" in self.peak_flops else next(iter(self.peak_flops))
        return self.peak_flops[key]

    def decode_row_ratio(self, dtype: str, bytes_per_weight: float) -> float:
        """One token's matmuls (2 FLOPs a weight, at peak) over one read of the weights (at peak
        bandwidth): what a decode row adds to a memory-bound step, as a share of the step's weight read."""
        return 2.0 * self.memory_bandwidth / (self.flops_for(dtype) * bytes_per_weight)

    def ridge_point(self, dtype: str = "bf16") -> float:
        """FLOPs per byte at which a kernel turns from bandwidth- to compute-bound."""
        return self.flops_for(dtype) / self.memory_bandwidth


def _tensor_core(bf16_tflops: float, fp32_tflops: float, int8_tops: float,
                 fp8_tflops: float | None = None) -> dict[str, float]:
    flops = {"bf16": bf16_tflops * TERA, "fp16": bf16_tflops * TERA, "fp32": fp32_tflops * TERA,
             "int8": int8_tops * TERA}
    if fp8_tflops:
        flops["fp8"] = fp8_tflops * TERA
    return flops


HARDWARE: dict[str, Hardware] = {
    hw.name: hw
    for hw in [
        Hardware("h100-sxm", _tensor_core(989.4, 66.9, 1978.9, 1978.9), 3.35e12, 80 * GB, 450 * GB),
        Hardware("h100-pcie", _tensor_core(756.0, 51.2, 1513.0, 1513.0), 2.0e12, 80 * GB, 64 * GB),
        # A copy: 4.24 of 4.8 TB/s (copy_bandwidth_gbps_per_gpu in benchmarks/results/gpu_tp_h200x4.json).
        Hardware("h200", _tensor_core(989.4, 66.9, 1978.9, 1978.9), 4.8e12, 141 * GB, 450 * GB,
                 copy_efficiency=4.24 / 4.8),
        Hardware("a100-40gb", _tensor_core(312.0, 19.5, 624.0), 1.555e12, 40 * GB, 300 * GB),
        Hardware("a100-80gb", _tensor_core(312.0, 19.5, 624.0), 2.039e12, 80 * GB, 300 * GB),
        Hardware("l4", _tensor_core(121.0, 30.3, 242.5, 242.5), 0.3e12, 24 * GB, 32 * GB),
        Hardware("a10g", _tensor_core(70.0, 31.2, 140.0), 0.6e12, 24 * GB, 32 * GB,
                 note="AWS A10G; tensor peaks are lower than the A10's"),
        Hardware("cpu", {"fp32": 1.0 * TERA, "bf16": 1.0 * TERA, "fp16": 1.0 * TERA, "int8": 2.0 * TERA},
                 0.1e12, 64 * GB, 10 * GB, note="a generic server CPU (link: gloo through shared memory, "
                                                "a guess); use --measure for this machine",
                 copy_efficiency=1.0),  # its bandwidth is a guess at what a copy reaches, not a datasheet's
    ]
}

ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb", "generic-cpu": "cpu"}

# Substrings of torch.cuda.get_device_name() -> hardware table entry, most specific first.
_GPU_NAMES = (("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"), ("H200", "h200"),
              ("A100-SXM4-40GB", "a100-40gb"), ("A100-PCIE-40GB", "a100-40gb"), ("A100", "a100-80gb"),
              ("L4", "l4"), ("A10G", "a10g"))


def hardware_for_device(device: str, device_name: str) -> str | None:
    """The HARDWARE key of a torch device ("cpu", or "cuda" and its device name); None: not in the table."""
    if device == "cpu":
        return "cpu"
    return next((key for part, key in _GPU_NAMES if part.lower() in device_name.lower()), None)


def get_hardware(name: str) -> Hardware:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in HARDWARE:
        raise InvalidRequestError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)} "
                                  f"(or --measure to probe this machine)")
    return HARDWARE[key]


def _best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_local(device: str = "auto", copy_bytes: int | None = None, matmul_n: int | None = None,
                  repeats: int = 5) -> Hardware:
    """Measured copy bandwidth (bytes read + written per second) and bf16/fp32 matmul rate."""
    import torch

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    on_gpu = dev.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    copy_bytes = copy_bytes or (1 << 30 if on_gpu else 1 << 27)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)
        sync()

    copy()  # first touch allocates pages / warms the driver
    bandwidth = 2 * copy_bytes / _best_of(copy, repeats)
    n = matmul_n or (8192 if on_gpu else 1024)
    flops = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a = torch.randn(n, n, dtype=dtype, device=dev)
        b = torch.randn(n, n, dtype=dtype, device=dev)

        def matmul():
            torch.matmul(a, b)
            sync()

        matmul()
        flops[name] = 2 * n**3 / _best_of(matmul, repeats)
    flops["fp16"] = flops["bf16"]
    memory = (torch.cuda.get_device_properties(dev).total_memory if on_gpu else _host_memory_bytes())
    name = torch.cuda.get_device_name(dev) if on_gpu else "local cpu"
    return Hardware(f"measured: {name}", flops, bandwidth, memory, note="measured here", measured=True,
                    copy_efficiency=1.0)  # the bandwidth is a copy's


def _host_memory_bytes() -> float:
    import os

    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
