"""The mixture-of-experts block that replaces the MLP in Mixtral and Qwen3-MoE layers.

Parameter names follow the checkpoints' where they can (`gate` is the router); the experts are
stacked into two parameters (ops/moe.py's layout) that the loaders fill expert by expert. With
--quantization int8 the stacks are int8 codes with a scale per output row (quant/schemes.py), built
before the load and written row block by row block as the loaders fill them (Int8Rows): the float
experts never exist whole on the device (Mixtral-8x7B's are 90 GB in bf16, 45 GB in int8).
"""

from __future__ import annotations

import torch
from torch import nn

from goodserve.errors import InvalidRequestError
from goodserve.model.spec import ModelSpec
from goodserve.ops.kernel_choice import TORCH_KERNELS
from goodserve.ops.moe import moe_torch, route
from goodserve.quant import schemes

EXPERT_QUANTIZATIONS = ("int8",)
QUANTIZE_CHUNK_BYTES = 64 << 20  # float32 rows quantized at once while filling (bounds the load's extra memory)


def check_moe_combination(spec: ModelSpec, tensor_parallel_size: int, quantization: str | None = None) -> None:
    """Tensor parallelism would need each rank's share of every expert (or whole experts per rank,
    with the all-to-all that needs): not built, so refused rather than run unsplit. Of the weight
    quantizations, the experts take int8 only (int4 would leave them, most of the bytes, in float)."""
    if not spec.is_moe:
        return
    if tensor_parallel_size > 1:
        raise InvalidRequestError(f"{spec.name} is a mixture of experts: --tensor-parallel-size > 1 is not "
                                  "supported for it")
    if quantization not in (None, "none", "gguf", *EXPERT_QUANTIZATIONS):
        raise InvalidRequestError(f"{spec.name} is a mixture of experts: weight quantization {quantization} of "
                                  f"its experts is not supported; use --quantization int8")


class Experts(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
        self.w13 = nn.Parameter(torch.empty(e * 2 * i, h))
        self.w2 = nn.Parameter(torch.empty(e * h, i))

    def stacks(self) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        """(w13, w2, w13 scales, w2 scales): what the MoE ops take; float stacks have no scales."""
        return self.w13, self.w2, None, None


class Int8Rows:
    """Rows of an int8 matrix with a scale per row, written as float: each row block is quantized as
    it is copied in (per-row scales make that exact whatever the blocks). Stands for a float
    parameter in model/llama.WeightFiller, which slices rows, reads .shape and calls copy_."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor):
        self.qweight, self.scales = qweight, scales

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def __getitem__(self, rows: slice) -> Int8Rows:
        return Int8Rows(self.qweight[rows], self.scales[rows])

    def copy_(self, tensor: torch.Tensor) -> None:
        chunk = max(1, QUANTIZE_CHUNK_BYTES // (4 * tensor.shape[1]))
        for start in range(0, tensor.shape[0], chunk):
            rows = slice(start, start + chunk)
            q = schemes.quantize_int8(tensor[rows].to(self.qweight.device))
            self.qweight[rows].copy_(q.qweight)
            self.scales[rows].copy_(q.scales)


class Int8Experts(nn.Module):
    """Experts' stacks as int8 codes [rows, K] and float32 scales [rows], one per output row."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
        for name, rows, cols in (("w13", e * 2 * i, h), ("w2", e * h, i)):
            self.register_buffer(f"{name}_qweight", torch.empty(rows, cols, dtype=torch.int8))
            self.register_buffer(f"{name}_scales", torch.empty(rows, dtype=torch.float32))

    def stacks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.w13_qweight, self.w2_qweight, self.w13_scales, self.w2_scales

    def row_writers(self) -> dict[str, Int8Rows]:
        """The float parameters' names (as Experts has them) -> where a loader writes their rows."""
        return {"w13": Int8Rows(self.w13_qweight, self.w13_scales), "w2": Int8Rows(self.w2_qweight, self.w2_scales)}


def quantize_experts_on_build(model: nn.Module, quantization: str | None) -> None:
    """Swap every SparseMoE's float Experts for Int8Experts (on the meta device, before allocation)."""
    if quantization not in EXPERT_QUANTIZATIONS:
        return
    for module in model.modules():
        if isinstance(module, SparseMoE):
            module.experts = Int8Experts(module.spec)


class SparseMoE(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.top_k, self.renormalize = spec.num_experts_per_tok, spec.norm_topk_prob
        self.gate = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        self.experts = Experts(spec)
        self.kernels = TORCH_KERNELS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w13, w2, w13_scales, w2_scales = self.experts.stacks()
        if self.kernels.triton:
            from goodserve.ops.triton_moe import triton_fused_moe, triton_route

            weights, ids = triton_route(self.gate(x), self.top_k, self.renormalize)
            return triton_fused_moe(x, w13, w2, weights, ids, self.kernels, w13_scales, w2_scales)
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        return moe_torch(x, w13, w2, weights, ids, self.kernels, w13_scales, w2_scales)
