"""The mixture-of-experts block that replaces the MLP in Mixtral and Qwen3-MoE layers.

Parameter names follow the checkpoints' where they can (`gate` is the router); the experts are
stacked into two parameters (quant/moe.py's layout) that the loaders fill expert by expert. With
--quantization int8 / int4 the stacks are codes with their scales (quant/schemes.py), built before
the load and written row block by row block as the loaders fill them (QuantizedRows): the float
experts never exist whole on the device (Mixtral-8x7B's are 90 GB in bf16, 45 GB in int8).

Under tensor parallelism (model/tensor_parallel.py) the stacks hold the rank's columns of every
expert, and their codes are the whole model's slice, as quant/apply.py makes a split linear's: int4
keeps the group size the whole experts get (a rank's share of the down projection must hold whole
groups), int8 scales the down projection's rows by their largest magnitude over every rank's columns.
"""

from __future__ import annotations

import torch
from torch import nn

from goodserve.errors import InvalidRequestError
from goodserve.model.spec import ModelSpec
from goodserve.ops.kernel_choice import TORCH_KERNELS
from goodserve.quant.moe import moe_torch, route
from goodserve.quant import schemes

EXPERT_QUANTIZATIONS = ("int8", "int4")
QUANTIZE_CHUNK_BYTES = 64 << 20  # float32 rows quantized at once while filling (bounds the load's extra memory)


class Experts(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
        self.w13 = nn.Parameter(torch.empty(e * 2 * i, h))
        self.w2 = nn.Parameter(torch.empty(e * h, i))

    def stacks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) as the MoE ops take them (quant/moe.py)."""
        return self.w13, self.w2


class QuantizedRows:
    """Rows of a quantized matrix, written as float: each row block is quantized as it is copied in
    (int8's scales run per row and int4's groups along it, so the codes do not depend on the blocks).
    Stands for a float parameter in model/llama.WeightFiller, which slices rows, reads .shape and
    calls copy_."""

    def __init__(self, weight: schemes.Int8Weight | schemes.Int4Weight, columns: int):
        self.weight, self.columns = weight, columns  # columns: of the float matrix (int4 packs two a byte)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.weight.qweight.shape[0], self.columns))

    def __getitem__(self, rows: slice) -> QuantizedRows:
        return QuantizedRows(schemes.rows_of(self.weight, rows), self.columns)

    def copy_(self, tensor: torch.Tensor, row_absmax: torch.Tensor | None = None) -> None:
        """row_absmax: each row's largest magnitude where `tensor` holds some of its columns only (a
        tensor-parallel shard), so int8 gives the whole matrix's codes."""
        chunk = max(1, QUANTIZE_CHUNK_BYTES // (4 * tensor.shape[1]))
        for start in range(0, tensor.shape[0], chunk):
            rows = slice(start, start + chunk)
            device = self.weight.qweight.device
            absmax = None if row_absmax is None else row_absmax[rows].to(device)
            codes = schemes.quantize_like(self.weight, tensor[rows].to(device), absmax)
            schemes.copy_rows(schemes.rows_of(self.weight, rows), codes)


class QuantizedExperts(nn.Module):
    """Experts' stacks as codes with their scales (and int4's zeros), quant/schemes.py's layouts with
    the experts' rows one after another."""

    def __init__(self, spec: ModelSpec, method: str, group_size: int | None, shards: int = 1):
        """spec: the rank's shapes, its share of `shards` tensor-parallel ones."""
        super().__init__()
        e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
        if method == "int4":
            fitting = [g for g in schemes.INT4_GROUP_SIZES if h % g == 0 and i * shards % g == 0]
            group_size = group_size or max(fitting, default=min(schemes.INT4_GROUP_SIZES))  # none: refused below
            schemes.check_group_size(h, group_size, "the experts' gate and up projections")
            down = "the experts' down projection" + (f" (its 1/{shards} tensor-parallel shard)" if shards > 1 else "")
            schemes.check_group_size(i, group_size, down)
        self.method, self.group_size, self.columns = method, group_size, {"w13": h, "w2": i}
        for name, rows, cols in (("w13", e * 2 * i, h), ("w2", e * h, i)):
            for part, tensor in schemes.empty_codes(method, rows, cols, group_size).items():
                self.register_buffer(f"{name}_{part}", tensor)

    def stacks(self) -> tuple[schemes.Int8Weight | schemes.Int4Weight, schemes.Int8Weight | schemes.Int4Weight]:
        return self._stack("w13"), self._stack("w2")

    def _stack(self, name: str) -> schemes.Int8Weight | schemes.Int4Weight:
        parts = {part: self._buffers[f"{name}_{part}"] for part in schemes.CODE_PARTS[self.method]}
        if self.method == "int8":
            return schemes.Int8Weight(**parts)
        return schemes.Int4Weight(**parts, group_size=self.group_size)

    def row_writers(self) -> dict[str, QuantizedRows]:
        """The float parameters' names (as Experts has them) -> where a loader writes their rows."""
        return {name: QuantizedRows(self._stack(name), columns) for name, columns in self.columns.items()}


def quantize_experts_on_build(model: nn.Module, quantization: str | None, group_size: int | None) -> None:
    """Swap every SparseMoE's float Experts for QuantizedExperts (on the meta device, before
    allocation), refusing a group size that does not fit, or fp8 (no FP8 grouped GEMM for the experts
    yet), before any memory is taken."""
    moe_layers = [module for module in model.modules() if isinstance(module, SparseMoE)]
    if moe_layers and quantization == "fp8":
        raise InvalidRequestError(f"{model.spec.name} is a mixture of experts: quantization 'fp8' does not cover "
                                  "its experts yet; use --quantization int8 or int4")
    if quantization not in EXPERT_QUANTIZATIONS:
        return
    for module in moe_layers:
        module.experts = QuantizedExperts(module.spec, quantization, group_size, model.tp.size)


class Router(nn.Linear):
    """The router's linear (the checkpoints' `gate`), a class of its own so that the swaps of plain
    nn.Linears (ops/cpu_linear's packing, ops/gemv_linear's GEMV routing) pass it by: decode's fused
    router launch (quant/triton_moe.triton_router) reads its weight as it is."""


class SparseMoE(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.top_k, self.renormalize = spec.num_experts_per_tok, spec.norm_topk_prob
        self.gate = Router(spec.hidden_size, spec.num_experts, bias=False)
        self.experts = Experts(spec)
        self.kernels = TORCH_KERNELS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.experts.stacks()
        if self.kernels.triton:
            from goodserve.quant.triton_moe import triton_moe

            return triton_moe(x, self.gate.weight, w13, w2, self.top_k, self.renormalize, self.kernels)
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        return moe_torch(x, w13, w2, weights, ids, self.kernels)

    def after_norm(self, sublayer_out: torch.Tensor, residual: torch.Tensor, norm: nn.Module
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this block of norm(sublayer_out, residual)'s normed rows, the new residual). Where
        fuses_norm, the residual add and the norm run inside the router's launch."""
        if not self.fuses_norm(sublayer_out, norm):
            x, residual = norm(sublayer_out, residual)
            return self(x), residual
        from goodserve.quant.triton_moe import triton_fused_moe, triton_norm_router

        x, residual, weights, ids = triton_norm_router(sublayer_out, residual, norm.weight, norm.eps, self.gate.weight,
                                                       self.top_k, self.renormalize, self.kernels.pdl)
        w13, w2 = self.experts.stacks()
        return triton_fused_moe(x, w13, w2, weights, ids, self.kernels), residual

    def fuses_norm(self, sublayer_out: torch.Tensor, norm: nn.Module) -> bool:
        """KernelOptions.moe_norm_router on the decode GEMV path, for a plain RMSNorm on one GPU (under
        tensor parallelism the norm's input is summed over the ranks first)."""
        if not (self.kernels.triton and self.kernels.options.moe_norm_router):
            return False
        from goodserve.quant.triton_moe import moe_kernel_for

        plain_norm = not norm.weight_offset and norm.tp.size == 1 and norm.weight.dtype == sublayer_out.dtype
        return plain_norm and moe_kernel_for(sublayer_out.shape[0] * self.top_k, *self.experts.stacks()) == "gemv"
