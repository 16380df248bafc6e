"""The decoder every family runs (model/families.py: Llama 2/3, Mistral, Qwen2/3, Phi-3, Mixtral,
Qwen3-MoE, Gemma 2/3) over a paged KV cache, its parts picked by the ModelSpec: q/k norms (Qwen3,
Gemma 3), the gated MLP (SwiGLU or GeGLU) or a mixture of experts (model/moe.py), Gemma's norms
(scaled by 1 + weight, and after each sublayer too), soft-capped attention scores and logits, a
second rotary table for the sliding layers (Gemma 3).

Tokens of all sequences in a batch are laid end to end ([T, hidden]); the attention metadata says
which sequence each belongs to. q/k/v and gate/up are fused into one matmul each; those linears are
plain nn.Linear so quantization can swap them by name. Modules that launch kernels hold the model's
KernelChoice (`kernels`: torch's until the engine gives them its own, ops/kernel_choice.use_kernels).

Under tensor parallelism (model/tensor_parallel.py) each rank builds the modules of its own shapes
(`tp.local_spec`) and joins them where they meet: o_proj's and down_proj's (and the experts')
partial sums all-reduced inside the residual add + RMSNorm after them (Gemma's: before the norm of
the sublayer's output), a masked lookup plus all-reduce in the embedding, an
all-gather of the logits. A stage hands its last layer's partial sums on, rank to rank of the same
tensor-parallel index, and the next stage's first norm sums them.

Under pipeline parallelism (model/pipeline_parallel.py) a stage builds only its layers (the others
stay as empty placeholders, so parameter names are the checkpoint's), the embedding on the first
stage, the final norm and lm_head on the last; forward receives the hidden states from the previous
stage and, except on the last, sends them on and returns None.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from goodserve.errors import ModelLoadError
from goodserve.model.moe import QuantizedRows, SparseMoE, quantize_experts_on_build
from goodserve.model.pipeline_parallel import PipelineParallel, check_pipeline_parallel_size
from goodserve.model.spec import ModelSpec
from goodserve.model.tensor_parallel import TensorParallel, check_tensor_parallel_size
from goodserve.ops.activation import gelu_tanh_and_mul, silu_and_mul
from goodserve.ops.attention import AttentionMetadata, LayerKVCache, attention
from goodserve.ops.kernel_choice import TORCH_KERNELS
from goodserve.ops.norm import HeadNorm, add_rms_norm, qk_rms_norm, rms_norm, split_qkv
from goodserve.ops.rotary import cos_sin_cache
from goodserve.quant.linear import Int4Linear


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, tp: TensorParallel = TensorParallel(),
                 weight_offset: float = 0.0):
        """weight_offset: Gemma's norms scale by (1 + weight); their inputs come summed over the ranks
        (LlamaDecoderLayer all-reduces each sublayer's output before its norm)."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.tp = tp
        self.weight_offset = weight_offset
        self.kernels = TORCH_KERNELS

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With a residual: x is a sublayer's output, under tensor parallelism this rank's partial sum;
        sum it over the ranks, add the residual and return (normed, new residual), fused."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.kernels, self.weight_offset)
        if self.weight_offset:
            return add_rms_norm(x, residual, self.weight, self.eps, self.kernels, self.weight_offset)
        return self.tp.all_reduce_add_rms_norm(x, residual, self.weight, self.eps, self.kernels)


class VocabParallelEmbedding(nn.Embedding):
    """The rank's rows of the table: ids of other ranks' rows look up zeros, the sum over ranks is
    the full lookup."""

    def __init__(self, rows: int, hidden_size: int, tp: TensorParallel):
        super().__init__(rows, hidden_size)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.tp.rank * self.num_embeddings
        outside = (local < 0) | (local >= self.num_embeddings)
        x = super().forward(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)


class LlamaAttention(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallel, window: int | None = None):
        """spec: the rank's shapes (its heads); window: the layer's sliding window, if it has one."""
        super().__init__()
        self.tp, self.window = tp, window
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = spec.q_size, spec.kv_size
        self.scale, self.softcap = spec.attention_scale, spec.attn_logit_softcap
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=False)
        # Qwen3, Gemma 3: each head's q and k RMS-normed over head_dim before rotary (weights replicated under TP).
        offset = spec.norm_weight_offset
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, weight_offset=offset) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, weight_offset=offset) if spec.qk_norm else None
        self.kernels = TORCH_KERNELS

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary_cache: torch.Tensor,
        kv_cache: LayerKVCache, meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.project_heads(x)
        out = attention(q, k, v, positions, rotary_cache, kv_cache, meta, self.scale, self.kernels, self.window,
                        self.softcap)
        return self.o_proj(out.flatten(1))  # a partial sum under TP: the next norm all-reduces it

    def project_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D] of the qkv projection, q and k RMS-normed where the model
        has q/k norms."""
        qkv = self.qkv_proj(x)
        if self.q_norm is None:
            return split_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim)
        return qk_rms_norm(qkv, HeadNorm(self.q_norm.weight, self.k_norm.weight, self.num_heads, self.num_kv_heads,
                                         self.head_dim, self.q_norm.eps, self.q_norm.weight_offset), self.kernels)


class LlamaMLP(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallel):
        """spec: the rank's shapes (its columns)."""
        super().__init__()
        self.tp = tp
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)
        self.geglu = spec.hidden_act == "gelu_tanh"
        self.kernels = TORCH_KERNELS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if self.geglu:
            hidden = gelu_tanh_and_mul(gate_up(x))
        elif isinstance(gate_up, Int4Linear):  # may finish SwiGLU inside its own kernel
            hidden = gate_up.silu_and_mul(x)
        else:
            hidden = silu_and_mul(gate_up(x), self.kernels)
        return self.down_proj(hidden)  # a partial sum under TP: the next norm all-reduces it


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallel, window: int | None = None):
        super().__init__()
        norm = lambda: RMSNorm(spec.hidden_size, spec.rms_norm_eps, tp, spec.norm_weight_offset)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = LlamaAttention(spec, tp, window)
        # Llama's post_attention_layernorm is the MLP's input norm; with sandwich norms (Gemma) it
        # norms the attention's output, and the MLP has a norm before and after it of its own.
        self.post_attention_layernorm = norm()
        self.tp, self.sandwich_norms = tp, spec.sandwich_norms
        if spec.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp = SparseMoE(spec) if spec.is_moe else LlamaMLP(spec, tp)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
        rotary_cache: torch.Tensor, kv_cache: LayerKVCache, meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add of the previous sublayer is fused into this norm (vLLM style).
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rotary_cache, kv_cache, meta)
        if self.sandwich_norms:  # the sublayers' partial sums are summed before their own norms
            x = self.post_attention_layernorm(self.tp.all_reduce(x))
            x, residual = self.pre_feedforward_layernorm(x, residual)
            return self.post_feedforward_layernorm(self.tp.all_reduce(self.mlp(x))), residual
        if isinstance(self.mlp, SparseMoE):
            return self.mlp.after_norm(x, residual, self.post_attention_layernorm)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallel, pp: PipelineParallel):
        """spec: the rank's shapes; layers outside the stage's range are empty placeholders."""
        super().__init__()
        held = pp.layers(spec.num_layers)
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp) \
            if pp.holds_embedding(spec) else None
        self.layers = nn.ModuleList(LlamaDecoderLayer(spec, tp, spec.window_of(i)) if i in held else nn.Identity()
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, tp, spec.norm_weight_offset) if pp.is_last else None


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TensorParallel = TensorParallel(),
                 pp: PipelineParallel = PipelineParallel()):
        """spec: the whole model's shapes; each rank builds its share (tp.local_spec, pp.layers)."""
        super().__init__()
        self.spec, self.tp, self.pp = spec, tp, pp
        local = tp.local_spec(spec)
        self.model = LlamaModel(local, tp, pp)
        self.lm_head = nn.Linear(spec.hidden_size, local.vocab_size, bias=False) if pp.is_last else None
        self.tie_weights()
        # Set on the CPU for int4 models (model/native_decode.py): runs the decode steps it takes
        # through all layers in one native call. Not a module, so the state dict is the same either way.
        self.native_decode = None
        self.kernels = TORCH_KERNELS  # what the engine's sampler and graphs launch beside the model
        # float32 whatever the model dtype: angles at large positions need the precision. Gemma 3's
        # sliding layers rotate by a table of their own (local_rotary_cache), the others by rotary_cache.
        self.register_buffer("rotary_cache", self._rotary_table(), persistent=False)
        self.register_buffer("local_rotary_cache", self._rotary_table(local=True), persistent=False)

    def _rotary_table(self, device: torch.device | None = None, local: bool = False) -> torch.Tensor | None:
        s = self.spec
        if local and s.rope_local_theta is None:
            return None
        theta, scaling = (s.rope_local_theta, None) if local else (s.rope_theta, s.rope_scaling)
        table = cos_sin_cache(s.head_dim, s.max_position_embeddings, theta, scaling)
        return table.to(device) if device is not None else table

    def _layer_rotary_caches(self, layers: range) -> list[torch.Tensor]:
        local = self.local_rotary_cache
        return [self.rotary_cache if local is None or self.spec.window_of(i) is None else local for i in layers]

    def tie_weights(self) -> None:
        if self.spec.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        kv_caches: list[LayerKVCache], meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """input_ids, positions: [T] -> final-normed hidden states [T, hidden]; None on a stage
        before the last (kv_caches: the stage's layers' own)."""
        meta = meta.for_new_step()
        held = self.pp.layers(self.spec.num_layers)
        layers = self.model.layers[held.start : held.stop]
        if self.pp.is_first:
            x, residual = self.model.embed_tokens(input_ids), None
            if self.spec.scale_embeddings:
                x = x * _rounded(self.spec.hidden_size**0.5, x.dtype)
        else:
            x, residual = self.pp.receive_from_previous(len(input_ids), self.spec.hidden_size,
                                                        layers[0].input_layernorm.weight)
        if self.native_decode is not None and self.native_decode.takes(x, kv_caches[0], meta):
            x, residual = self.native_decode(x, positions, self.rotary_cache, kv_caches, meta)
        else:
            for layer, kv_cache, rotary_cache in zip(layers, kv_caches, self._layer_rotary_caches(held)):
                x, residual = layer(x, residual, positions, rotary_cache, kv_cache, meta)
        if not self.pp.is_last:
            self.pp.send_forward(x, residual)
            return None
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (only the rows to sample from) -> float32 logits [N, vocab], soft-capped
        where the model caps them (Gemma 2)."""
        logits = self.tp.gather_vocab(self.lm_head(hidden), self.spec.vocab_size).float()
        cap = self.spec.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    """value as dtype holds it: Gemma scales its embeddings by sqrt(hidden) rounded to the model dtype."""
    return torch.tensor(value, dtype=dtype).item()


def build_empty_model(spec: ModelSpec, dtype: torch.dtype, device: torch.device | str,
                      tp: TensorParallel = TensorParallel(),
                      pp: PipelineParallel = PipelineParallel(), quantization: str | None = None,
                      group_size: int | None = None) -> LlamaForCausalLM:
    """The model (this rank's share of it) with uninitialized weights allocated straight on `device` in `dtype`.

    Built on the meta device first, so no CPU copy and no init pass happen (an 8B model would spend
    minutes in kaiming init); loaders then fill every parameter. quantization: the weight quantization
    asked for (group_size: int4's, None for the largest that divides); a mixture of experts'
    experts take it here, as codes the loaders fill (model/moe.py), the other linears after the
    load (quant/apply.py).
    """
    check_tensor_parallel_size(spec, tp.size)
    check_pipeline_parallel_size(spec, pp.size)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(spec, tp, pp)
            quantize_experts_on_build(model, quantization, group_size)
    finally:
        torch.set_default_dtype(default_dtype)
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty makes new Parameters, which unties them
    model.rotary_cache = model._rotary_table(torch.device(device))
    model.local_rotary_cache = model._rotary_table(torch.device(device), local=True)
    return model.eval().requires_grad_(False)


class WeightFiller:
    """Copies checkpoint tensors into the model's parameters, fused ones shard by shard.

    Checkpoints store q, k, v (and gate, up) separately; here they are row blocks of one matrix, as
    each expert's gate, up and down are row blocks of its layer's stacked experts (model/moe.py).
    Tensors come whole (as at TP=1); under tensor parallelism each rank copies its slice of them, under
    pipeline parallelism a stage skips the tensors of other stages.
    `finish` fails if any parameter row was never written: the model would run on garbage.
    `extra` names more tensors to fill the same way (a quantized layer's codes and scales); quantized
    experts (model/moe.QuantizedExperts) stand under their float parameters' names, quantizing what they get.
    """

    def __init__(self, model: LlamaForCausalLM, extra: dict[str, torch.Tensor] | None = None):
        self.spec, self.tp, self.pp = model.spec, model.tp, model.pp
        # A tied lm_head appears once, as the embedding.
        writers = {f"{path}.{name}": rows for path, module in model.named_modules()
                   if hasattr(module, "row_writers") for name, rows in module.row_writers().items()}
        self.params = dict(model.named_parameters()) | writers | (extra or {})
        self.shard_rows = _fused_rows(model.tp.local_spec(model.spec))
        self.rows_filled = dict.fromkeys(self.params, 0)

    @torch.no_grad()
    def fill(self, name: str, shard: str | None, tensor: torch.Tensor) -> None:
        if not self.pp.holds(name, self.spec):
            return
        if name not in self.params:
            raise ModelLoadError(f"checkpoint tensor for {name!r} does not fit this model")
        target = self.params[name]
        if shard is not None:
            start, rows = self.shard_rows[shard]
            target = target[start : start + rows]
        whole, tensor = tensor, self.tp.shard(name, shard, tensor, self.spec)
        if target.shape != tensor.shape:
            raise ModelLoadError(
                f"checkpoint tensor {name}{f' ({shard})' if shard else ''} has shape "
                f"{tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
            )
        if isinstance(target, QuantizedRows) and tensor.shape[1] != whole.shape[1]:  # some of each row's columns
            target.copy_(tensor, row_absmax=whole.abs().amax(dim=1).float())
        else:
            target.copy_(tensor)
        self.rows_filled[name] += tensor.shape[0]

    def fill_whole(self, name: str, tensor: torch.Tensor) -> None:
        """A parameter as the TP=1 model holds it, fused ones included."""
        parts = [(shard, start, rows) for shard, (start, rows) in _fused_rows(self.spec).items()
                 if _fills(shard, name)]
        if not parts:
            return self.fill(name, None, tensor)
        for shard, start, rows in parts:
            self.fill(name, shard, tensor[start : start + rows])

    def finish(self) -> None:
        missing = [n for n, p in self.params.items() if self.rows_filled[n] != p.shape[0]]
        if missing:
            raise ModelLoadError(f"checkpoint is missing weights for: {', '.join(missing[:5])}")


_FUSED_MODULES = {"q": "qkv_proj", "k": "qkv_proj", "v": "qkv_proj", "gate": "gate_up_proj", "up": "gate_up_proj"}
_EXPERT_STACKS = {"gate": "experts.w13", "up": "experts.w13", "down": "experts.w2"}


def _fills(shard: str | tuple[str, int], name: str) -> bool:
    """Whether the fused shard (_fused_rows' key) is rows of parameter `name`."""
    if isinstance(shard, tuple):
        return name.endswith(f".{_EXPERT_STACKS[shard[0]]}")
    return shard in _FUSED_MODULES and f".{_FUSED_MODULES[shard]}." in name


def _fused_rows(s: ModelSpec) -> dict[str | tuple[str, int], tuple[int, int]]:
    """Where each shard's rows start in its fused matrix, and how many there are; an expert's shards
    are keyed (shard, expert)."""
    i, h = s.moe_intermediate_size, s.hidden_size
    experts = {key: rows for e in range(s.num_experts) for key, rows in (
        (("gate", e), (2 * i * e, i)), (("up", e), (2 * i * e + i, i)), (("down", e), (h * e, h)))}
    return {"q": (0, s.q_size), "k": (s.q_size, s.kv_size), "v": (s.q_size + s.kv_size, s.kv_size),
            "gate": (0, s.intermediate_size), "up": (s.intermediate_size, s.intermediate_size)} | experts
