"""Tensor parallelism (Megatron style): which slice of each weight a rank holds, and the collectives
that join the slices.

Per layer: the fused qkv and gate_up are column-parallel (a rank holds its query heads, their KV
heads and its columns of gate and of up), o_proj and down_proj row-parallel (the matching input
columns), each followed by one all-reduce, which the residual add and RMSNorm after it take in
(`all_reduce_add_rms_norm`: the sublayers return their partial sums). Gemma norms each sublayer's
output before the residual add: there the sum is all-reduced before that norm. A mixture of experts
splits every expert the same way: a rank holds its columns of each expert's gate and up and the
matching input columns of its down (model/moe.py's stacks of the rank's shapes), the router is
replicated, and the routed experts' weighted sum is one partial sum, all-reduced as the MLP's.
The embedding and lm_head are vocab-parallel: a rank holds a contiguous range of ceil(vocab / N)
rows (the last padded with zeros); the lookup masks the ids outside its range and all-reduces, the
logits are all-gathered. Norms are replicated. The same slicing serves a GGUF layer's codes (packed
nibbles, scales and zeros per block of 32 inputs: rows are rows, and a row-parallel shard's columns
are the same share of each).

The all-reduces go through NCCL (gloo on the CPU), except small ones on CUDA where the ranks share a
host: those take the one-shot all-reduce on symmetric memory (custom_all_reduce.py), set up by the
worker and held here.

KV heads: with N <= num_kv_heads each rank holds num_kv_heads / N of them; with more ranks than
KV heads each KV head is replicated on N / num_kv_heads ranks (the ranks whose query heads read it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from goodserve.errors import InvalidRequestError
from goodserve.model.custom_all_reduce import CustomAllReduce
from goodserve.model.spec import ModelSpec
from goodserve.ops.kernel_choice import KernelChoice
from goodserve.ops.norm import add_rms_norm


def check_tensor_parallel_size(spec: ModelSpec, size: int) -> None:
    """The split points must fall on whole heads and whole MLP columns (as vLLM requires)."""
    if size == 1:
        return
    valid = [n for n in range(1, spec.num_heads + 1) if _fits(spec, n)]
    if not _fits(spec, size):
        mlp = "each expert's intermediate size" if spec.is_moe else "the intermediate size"
        raise InvalidRequestError(
            f"--tensor-parallel-size {size} does not split {spec.name} ({spec.num_heads} attention heads, "
            f"{spec.num_kv_heads} KV heads, {mlp} {_mlp_columns(spec)}): the size must divide "
            f"the attention heads and {mlp}, and divide or be a multiple of the KV heads; "
            f"valid sizes: {', '.join(map(str, valid))}")


def _mlp_columns(spec: ModelSpec) -> int:
    """The columns a rank takes its share of: each expert's under a mixture of experts (a MoE
    checkpoint's dense intermediate_size, where it has one, sizes no weight)."""
    return spec.moe_intermediate_size if spec.is_moe else spec.intermediate_size


def _fits(spec: ModelSpec, n: int) -> bool:
    kv = spec.num_kv_heads
    return spec.num_heads % n == 0 and _mlp_columns(spec) % n == 0 and (kv % n == 0 or n % kv == 0)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    # The ranks this one's collectives join: None, all of them (the default group); under pipeline
    # parallelism its stage's ranks (engine/worker/distributed.py).
    group: dist.ProcessGroup | None = None
    # The group's all-reduce of small CUDA tensors, where it could be set up (engine/worker/worker.py).
    custom_all_reduce: CustomAllReduce | None = None

    # ---- local shapes --------------------------------------------------------------------
    def local_spec(self, spec: ModelSpec) -> ModelSpec:
        """The rank's own shapes: its heads, KV heads, MLP columns and vocab rows (what its modules
        and its KV cache are sized by)."""
        if self.size == 1:
            return spec
        return dataclasses.replace(
            spec, num_heads=spec.num_heads // self.size, num_kv_heads=max(1, spec.num_kv_heads // self.size),
            intermediate_size=spec.intermediate_size // self.size,
            moe_intermediate_size=spec.moe_intermediate_size // self.size, vocab_size=self.vocab_rows(spec))

    def vocab_rows(self, spec: ModelSpec) -> int:
        return -(-spec.vocab_size // self.size)

    def first_kv_head(self, spec: ModelSpec) -> int:
        kv = spec.num_kv_heads
        return self.rank * kv // self.size if kv >= self.size else self.rank // (self.size // kv)

    # ---- slicing a full checkpoint tensor ------------------------------------------------
    def shard(self, name: str, part: str | tuple[str, int] | None, full: torch.Tensor,
              spec: ModelSpec) -> torch.Tensor:
        """This rank's slice of a full (TP=1) tensor: `name` is the parameter, `part` the fused shard
        (q, k, v, gate, up; an expert's (gate | up | down, expert)) the tensor fills, as
        model/llama.WeightFiller names them."""
        if self.size == 1:
            return full
        local = self.local_spec(spec)
        if isinstance(part, tuple):  # one expert's projection: its gate and up rows, its down's columns
            columns = local.moe_intermediate_size
            if part[0] == "down":
                return full[:, self.rank * columns : (self.rank + 1) * columns]
            return _rows(full, self.rank * columns, columns)
        if part == "q":
            return _rows(full, self.rank * local.q_size, local.q_size)
        if part in ("k", "v"):
            return _rows(full, self.first_kv_head(spec) * spec.head_dim, local.kv_size)
        if part in ("gate", "up"):
            return _rows(full, self.rank * local.intermediate_size, local.intermediate_size)
        if is_row_parallel(name):  # a slice of the input columns, or of their codes (packed, per group)
            columns = full.shape[1] // self.size
            return full[:, self.rank * columns : (self.rank + 1) * columns]
        if name == "model.embed_tokens.weight" or name.startswith("lm_head."):
            rows = _rows(full, self.rank * local.vocab_size, local.vocab_size)
            return F.pad(rows, (0, 0, 0, local.vocab_size - rows.shape[0]))  # the last rank's padding
        return full  # norms: replicated

    # ---- collectives ---------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of the ranks' partial results (row-parallel outputs, masked embedding rows): x
        itself, summed in place, or a new tensor where the custom all-reduce takes x."""
        if self.size == 1:
            return x
        if self.custom_all_reduce is not None and self.custom_all_reduce.takes(x):
            return self.custom_all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                kernels: KernelChoice) -> tuple[torch.Tensor, torch.Tensor]:
        """add_rms_norm of the sum of the ranks' partial x: one kernel where the custom all-reduce
        fuses it (ops/all_reduce_norm.py), else the all-reduce and then the norm's kernel."""
        if self.size > 1 and self.custom_all_reduce is not None and self.custom_all_reduce.fuses(x):
            return self.custom_all_reduce.add_rms_norm(x, residual, weight, eps)
        return add_rms_norm(self.all_reduce(x), residual, weight, eps, kernels)

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def broadcast_from_first(self, x: torch.Tensor) -> None:
        if self.size > 1:
            dist.broadcast(x, src=0 if self.group is None else dist.get_global_rank(self.group, 0),
                           group=self.group)

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[N, vocab rows] on each rank -> [N, vocab] on every rank (so each can sample)."""
        if self.size == 1:
            return logits
        rows, columns = logits.shape
        parts = logits.new_empty((self.size * rows, columns))  # rank after rank
        dist.all_gather_into_tensor(parts, logits.contiguous(), group=self.group)
        return parts.view(self.size, rows, columns).movedim(0, 1).reshape(rows, self.size * columns)[:, :vocab_size]


def is_row_parallel(name: str) -> bool:
    return ".o_proj." in name or ".down_proj." in name


def _rows(full: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return full[start : start + count]
