"""Attention over the paged KV cache: the batch metadata, the cache write and the plain-torch path.

One batch holds B sequences; sequence i contributes q_len_i new tokens (a prefill chunk, or 1 for
decode), laid end to end in a flat [T, ...] batch. Its context after this step is seq_len_i tokens,
so its new queries sit at positions seq_len_i - q_len_i ... seq_len_i - 1, and each attends every
cached key at a position <= its own (causal); in a layer with a sliding window W, only the keys at
positions j with i - j < W (the last W, its own included: transformers' rule). With a soft cap c
(Gemma 2) each scaled score s becomes tanh(s / c) * c before the softmax. K/V live in blocks of
`block_size` token slots; slot = block_id * block_size + offset.

The Triton kernels (ops/triton_attention.py) compute the same function; this file is their reference,
the CPU path, and the dispatch between the two (by the model's KernelChoice, ops/kernel_choice.py).
The model calls one entry point per layer, `attention` (RoPE, cache write, attention). A CPU step of
a 135M model is mostly per-op dispatch cost (30 layers x dozens of tiny ops), so in float32 the CPU
runs two native calls (native/layer_ops.cpp, decode_attention.cpp); elsewhere its torch path derives
what depends only on the step (RoPE rows, write slots, gather indices) once per step
(`StepIndices`), and one sequence's decode attention is two small matmuls over one block gather,
not masked SDPA.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from goodserve.native import layer_ops
from goodserve.ops.flash_prefill import flash_prefill, flash_prefill_sequences
from goodserve.ops.kernel_choice import KernelChoice
from goodserve.ops.kv_exchange import KVExchange
from goodserve.ops.rotary import apply_rotary_torch
from goodserve.ops.tree_attention import SideBranches, as_cached, branch_attention

INT8_MAX = 127.0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int32; -1 marks a padding token whose K/V is not written
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative q lengths
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new)
    # [B, max_blocks] int32, any strides; entries past a sequence's blocks are never read for
    # attention (0 on the eager path, whatever an earlier step left in a decode graph's table).
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # Host copies, so the torch path never synchronizes with the device to read lengths.
    query_lens_host: list[int]
    seq_lens_host: list[int]
    # How many sequences at the head of the batch have one query each (decodes); in a mixed batch the
    # Triton path gives those to the decode kernel. 0 is always correct, only slower.
    num_leading_decodes: int = 0
    # A mixed-step CUDA graph's count of leading decodes: an int32 device scalar, set per replay
    # (num_leading_decodes is then 0); the kernels' grids cover any count. With it, at most
    # max_prefill_seqs sequences follow the leading decodes (the graph's bound, which sizes a grid).
    leading_decodes: torch.Tensor | None = None
    max_prefill_seqs: int | None = None
    # The torch path's per-step indices, derived by the first layer that needs them and reused by
    # the rest. The model's forward attaches fresh ones each step (a decode graph reuses its metadata).
    step_indices: StepIndices | None = field(default=None, repr=False, compare=False)
    # Tokens of side branches (lookahead's guesses, ops/tree_attention.py) at the end of the batch;
    # the fields above then describe the rows before them only (its `main` metadata) plus these.
    branches: SideBranches | None = None
    # Context parallelism (engine/worker/context_parallel.py): these rows are this rank's share of the
    # step's tokens; each layer gathers every rank's new K/V into the cache before attending.
    kv_exchange: KVExchange | None = None
    # A pool of several layer groups (engine/setup/kv_groups.py): per group, this metadata with the group's
    # own slot_mapping and block_tables (the fields above are group 0's). Empty: one group.
    groups: tuple[AttentionMetadata, ...] = ()

    def for_new_step(self) -> AttentionMetadata:
        """This metadata with empty per-step indices, for one forward pass."""
        return replace(self, step_indices=StepIndices(self), groups=tuple(g.for_new_step() for g in self.groups))

    def for_group(self, group: int) -> AttentionMetadata:
        """What the layers of one group of the KV pool attend with."""
        return self.groups[group] if self.groups else self

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass
class LayerKVCache:
    """One layer's K and V pools: [num_blocks, block_size, num_kv_heads, head_dim].

    dtype is the model's, int8 (with a float32 scale per token slot and head), or float8_e4m3fn.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads], int8 only
    v_scale: torch.Tensor | None = None
    group: int = 0  # the layer's group in the pool (engine/setup/kv_groups.py): whose block ids it reads

    @property
    def block_size(self) -> int:
        return self.k.shape[1]


def quantize_int8_per_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H, D] -> (int8 values, float32 scale [T, H]) with x ~= values * scale."""
    scale = x.float().abs().amax(dim=-1).clamp(min=1e-8) / INT8_MAX
    values = torch.round(x.float() / scale.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return values, scale


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
              rotary_cache: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float,
              kernels: KernelChoice, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """One layer: RoPE on q [T, Hq, D] (in place) and k [T, Hk, D], the new K/V into the cache, then
    q attending its context (its last `window` keys, when the layer has one; scores soft-capped at
    `softcap`, when it has one) -> [T, Hq, D]. A
    decode-only step with KernelOptions.fuse_rotary_into_decode_attention does all of it in the
    decode kernel, and q is left unrotated."""
    meta = meta.for_group(cache.group)
    if meta.branches is not None:
        assert window is None and softcap is None, "side branches attend the whole context, uncapped (the engine " \
            "refuses them with a window, which every soft-capped family has)"
        return _with_side_branches(q, k, v, positions, rotary_cache, cache, meta.branches, scale, kernels)
    if kernels.triton:
        if meta.is_decode_only and kernels.options.fuse_rotary_into_decode_attention and meta.kv_exchange is None:
            from goodserve.ops.triton_attention import NewTokens, triton_decode_attention

            return triton_decode_attention(
                q, cache, meta.block_tables, meta.seq_lens, scale, tuning=kernels.decode_attention_tuning(q.shape[0]),
                pdl=kernels.pdl, waves=kernels.options.decode_attention_waves, window=window, softcap=softcap,
                new_tokens=NewTokens(k, v, positions, rotary_cache, meta.slot_mapping))
        rotary_write_kv(q, k, v, positions, rotary_cache, cache, meta.slot_mapping, kernels)
        _share_new_kv(cache, meta)
        return paged_attention(q, cache, meta, scale, kernels, window, softcap)
    if softcap is None and native_attention_usable(q, cache):  # the native kernels have no soft cap
        layer_ops.rope_write_kv(q, k, v, positions, rotary_cache, cache.k, cache.v, meta.slot_mapping)
        _share_new_kv(cache, meta)
        if meta.is_decode_only:
            return layer_ops.decode_attention(q, cache.k, cache.v, meta.block_tables, meta.seq_lens, scale, window)
        return paged_attention_reference(q, cache, meta, scale, window)
    indices = step_indices(meta)
    cos, sin = indices.rope(positions, rotary_cache)
    q.copy_(rotate(q, cos, sin))
    write_kv_slots(rotate(k, cos, sin), v, cache, *indices.write())
    _share_new_kv(cache, meta)
    return paged_attention_torch(q, cache, meta, scale, window, softcap)


def _share_new_kv(cache: LayerKVCache, meta: AttentionMetadata) -> None:
    """Under context parallelism, the other ranks' new K/V beside this one's, before any query attends."""
    if meta.kv_exchange is not None:
        meta.kv_exchange.share(cache)


def with_kv_groups(meta: AttentionMetadata, slot_mappings: torch.Tensor,
                   block_tables: torch.Tensor) -> AttentionMetadata:
    """meta over a pool of G layer groups: slot_mappings [G, T], every group's slots of each token;
    block_tables [B, G * blocks], the groups' tables interleaved (engine/core/kv_cache_manager.py)."""
    num_groups = slot_mappings.shape[0]
    if num_groups == 1:
        return replace(meta, slot_mapping=slot_mappings[0], block_tables=block_tables)
    groups = tuple(replace(meta, slot_mapping=slot_mappings[g], block_tables=block_tables[:, g::num_groups])
                   for g in range(num_groups))
    return replace(groups[0], groups=groups)


def _with_side_branches(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        rotary_cache: torch.Tensor, cache: LayerKVCache, branches: SideBranches, scale: float,
                        kernels: KernelChoice) -> torch.Tensor:
    """The batch's own rows the usual way (their K/V written first), then the branch rows over the
    context those rows leave in the cache."""
    n, out = branches.first_row, torch.empty_like(q)
    out[:n] = attention(q[:n], k[:n], v[:n], positions[:n], rotary_cache, cache, branches.main, scale, kernels)
    branch_q, branch_k = apply_rotary_torch(q[n:], k[n:], positions[n:], rotary_cache)
    tables = branches.main.block_tables
    contexts = [gather_kv(cache, tables[t.seq, : -(-t.context_len // cache.block_size)].long(), t.context_len, q.dtype)
                for t in branches.trees]
    out[n:] = branch_attention(branch_q, as_cached(branch_k, cache.k), as_cached(v[n:], cache.v),
                               [c[0] for c in contexts], [c[1] for c in contexts], branches.trees, scale)
    return out


def native_attention_usable(q: torch.Tensor, cache: LayerKVCache) -> bool:
    """The native CPU kernels (native/): float32 queries and K/V pools, head_dim a multiple of 16."""
    return cache.k_scale is None and q.shape[-1] % 16 == 0 and layer_ops.usable(q, cache.k)


def rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    rotary_cache: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor,
                    kernels: KernelChoice) -> None:
    """RoPE on q ([T, Hq, D], in place) and k; then the new tokens' K/V ([T, Hk, D]) into their
    slots, quantized for an int8/fp8 cache. One fused kernel on the Triton path."""
    if kernels.triton:
        from goodserve.ops.triton_attention import triton_rotary_write_kv

        triton_rotary_write_kv(q, k, v, positions, rotary_cache, cache, slot_mapping, pdl=kernels.pdl)
    else:
        rotary_write_kv_torch(q, k, v, positions, rotary_cache, cache, slot_mapping)


def paged_attention(q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float,
                    kernels: KernelChoice, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D], attending this step's context (K/V already written)."""
    if not kernels.triton:
        return paged_attention_torch(q, cache, meta, scale, window, softcap)
    from goodserve.ops.triton_attention import triton_decode_attention, triton_prefill_attention

    pdl, waves = kernels.pdl, kernels.options.decode_attention_waves
    if meta.is_decode_only:
        return triton_decode_attention(q, cache, meta.block_tables, meta.seq_lens, scale, pdl=pdl, waves=waves,
                                       tuning=kernels.decode_attention_tuning(q.shape[0]), window=window,
                                       softcap=softcap)
    out, decodes, first_seq = torch.empty_like(q), meta.num_leading_decodes, meta.num_leading_decodes
    if meta.leading_decodes is not None:  # any of the rows may be a decode
        decodes, first_seq = min(q.shape[0], meta.seq_lens.shape[0]), meta.leading_decodes
    if decodes:
        triton_decode_attention(q[:decodes], cache, meta.block_tables[:decodes], meta.seq_lens[:decodes], scale,
                                out=out[:decodes], num_decodes=meta.leading_decodes, pdl=pdl, waves=waves,
                                tuning=kernels.decode_attention_tuning(decodes), window=window, softcap=softcap)
    splits = None if kernels.options.split_prefill_attention else 1  # None: the kernel's choice
    flash = flash_prefill_sequences(q, cache.k.shape[2], meta.query_lens_host, meta.num_leading_decodes,
                                    kernels.options.flash_prefill_min_tokens, window, softcap)
    if flash:
        return _prefill_with_flash(q, cache, meta, scale, flash, out, pdl, splits)
    return triton_prefill_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
                                    first_seq=first_seq, out=out, max_seqs=meta.max_prefill_seqs, pdl=pdl,
                                    window=window, softcap=softcap, num_splits=splits)


def _prefill_with_flash(q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float,
                        flash: list[int], out: torch.Tensor, pdl: bool, splits: int | None) -> torch.Tensor:
    """An eager step's prefill sequences (after its leading decodes, already in `out`): those in
    `flash` through ops/flash_prefill.py, the runs between them through the Triton prefill kernel."""
    from goodserve.ops.triton_attention import triton_prefill_attention

    starts = [0, *itertools.accumulate(meta.query_lens_host)]
    for first, end in _runs_between(meta.num_leading_decodes, flash, len(meta.query_lens_host)):
        tokens = starts[end]  # the kernel computes sequences first..end-1 of this prefix of the batch
        triton_prefill_attention(q[:tokens], cache, meta.block_tables[:end], meta.seq_lens[:end],
                                 meta.query_start_loc[: end + 1], scale, first_seq=first, out=out[:tokens], pdl=pdl,
                                 num_splits=splits)
    for seq in flash:
        seq_len, rows = meta.seq_lens_host[seq], slice(starts[seq], starts[seq + 1])
        blocks = meta.block_tables[seq, : -(-seq_len // cache.block_size)].long()
        out[rows] = flash_prefill(q[rows], *gather_kv(cache, blocks, seq_len, q.dtype), scale)
    return out


def _runs_between(first_seq: int, chosen: list[int], num_seqs: int) -> list[tuple[int, int]]:
    """The runs [first, end) of sequences from first_seq on that are not in `chosen` (sorted)."""
    runs, first = [], first_seq
    for seq in [*chosen, num_seqs]:
        if seq > first:
            runs.append((first, seq))
        first = seq + 1
    return runs


def rotary_write_kv_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          rotary_cache: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
    """The reference: rotate q and k, store the rotated k and v."""
    rotated_q, rotated_k = apply_rotary_torch(q, k, positions, rotary_cache)
    q.copy_(rotated_q)
    write_kv_torch(rotated_k, v, cache, slot_mapping)


def write_kv_torch(k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
    """The reference cache write."""
    keep = slot_mapping >= 0
    write_kv_slots(k, v, cache, keep.nonzero().squeeze(1), slot_mapping[keep].long())


def write_kv_slots(k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache, rows: torch.Tensor | None,
                   slots: torch.Tensor) -> None:
    """K/V of token `rows` (None: all) into int64 `slots`, quantized for an int8/fp8 cache."""
    if rows is not None:
        k, v = k[rows], v[rows]
    num_kv_heads, head_dim = cache.k.shape[2], cache.k.shape[3]
    for x, pool, pool_scale in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
        flat = pool.view(-1, num_kv_heads, head_dim)
        if pool_scale is None:
            flat.index_put_((slots,), x.to(pool.dtype))  # index_put_, not index_copy_: it takes fp8
            continue
        values, scale = quantize_int8_per_head(x)
        flat.index_put_((slots,), values)
        pool_scale.view(-1, num_kv_heads).index_put_((slots,), scale)


def gather_kv(cache: LayerKVCache, block_ids: torch.Tensor, length: int, dtype: torch.dtype):
    """The first `length` tokens' K and V of one sequence, [length, Hk, D], dequantized to dtype. A pool
    without scales is gathered in its own dtype: no float32 copy of a long context on the way."""
    pools = ((cache.k, cache.k_scale), (cache.v, cache.v_scale))
    return tuple((pool.index_select(0, block_ids) if scale is None else gather_blocks(pool, scale, block_ids))
                 .flatten(0, 1)[:length].to(dtype) for pool, scale in pools)


def paged_attention_reference(
    q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float, window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]. One sequence at a time; the definition the kernels must match."""
    out = torch.empty_like(q)
    block_size = cache.block_size
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        num_blocks = -(-seq_len // block_size)
        k, v = gather_kv(cache, meta.block_tables[i, :num_blocks].long(), seq_len, q.dtype)
        out[start : start + q_len] = _causal_attention(q[start : start + q_len], k, v, scale, window, softcap)
        start += q_len
    return out


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      window: int | None, softcap: float | None = None) -> torch.Tensor:
    """q: [Lq, Hq, D] are the last Lq of the Lk positions in k, v: [Lk, Hk, D]."""
    q_len, k_len = q.shape[0], k.shape[0]
    query_pos = torch.arange(k_len - q_len, k_len, device=q.device).unsqueeze(1)
    key_pos = torch.arange(k_len, device=q.device).unsqueeze(0)
    mask = key_pos <= query_pos  # [Lq, Lk]
    if window is not None:
        mask &= key_pos > query_pos - window
    if softcap is not None:
        additive = torch.zeros(mask.shape, device=q.device).masked_fill(~mask, float("-inf"))
        return softcapped_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), additive, scale,
                                    softcap).transpose(0, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                         softcap: float) -> torch.Tensor:
    """q [..., Hq, Lq, D], k and v [..., Hk, Lk, D], the additive mask broadcast to the scores
    [..., Hq, Lq, Lk]: attention with soft-capped scores, as transformers' eager Gemma 2 computes it
    (SDPA has no soft cap)."""
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap + mask
    return scores.float().softmax(dim=-1).to(q.dtype) @ v


def decode_attention_torch(
    q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float, window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode-only batch (one query per sequence), vectorized over the batch: the CPU fast path.

    K/V are gathered block by block (whole blocks copy fast; token-sized rows do not) into
    [B, L, Hk, D], L the longest context rounded up to blocks, the rest masked. One sequence: each
    query head group meets its KV head in a [G, D] x [D, L] bmm on strided views (GQA by reshape,
    scale and mask folded into baddbmm), cheaper than SDPA's setup at this size. Several: SDPA,
    which reads the strided views without copying them. Float32 whatever the model dtype: on the
    CPU float32 small matmuls are faster than bfloat16 ones, and more exact.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = cache.k.shape[2]
    block_ids, mask = step_indices(meta).decode_gather(cache.block_size, window)  # [B * blocks], [B, 1, 1, L]
    k, v = (gather_blocks(pool, pool_scale, block_ids).view(batch, -1, num_kv_heads, head_dim)
            for pool, pool_scale in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)))
    if softcap is not None:
        out = softcapped_attention(q.float().unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), mask, scale, softcap)
        return out.squeeze(2).to(q.dtype)
    if batch > 1:
        out = F.scaled_dot_product_attention(q.float().unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads)
        return out.squeeze(2).to(q.dtype)
    grouped = q.float().view(num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.baddbmm(mask[0], grouped, k[0].permute(1, 2, 0), alpha=scale)  # [Hk, G, L]
    return torch.bmm(scores.softmax(dim=-1), v[0].transpose(0, 1)).view(1, num_heads, head_dim).to(q.dtype)


def gather_blocks(pool: torch.Tensor, scale: torch.Tensor | None, block_ids: torch.Tensor) -> torch.Tensor:
    """Blocks' K or V [len(block_ids), block_size, Hk, D] in float32, dequantized."""
    # index_select, not pool[block_ids]: on the CPU it gathers blocks several times faster.
    rows = pool.index_select(0, block_ids).float()
    return rows if scale is None else rows * scale.index_select(0, block_ids).unsqueeze(-1)


def paged_attention_torch(
    q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float, window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    if meta.is_decode_only:
        return decode_attention_torch(q, cache, meta, scale, window, softcap)
    return paged_attention_reference(q, cache, meta, scale, window, softcap)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as x * cos + swap_halves(x) * sin, with StepIndices.rope's full-width cos and signed sin
    ([T, 1, D]): the reference's arithmetic in three ops instead of a dozen. Float32 result."""
    x = x.float()
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # (x2, x1)
    return torch.addcmul(x * cos, swapped, sin)


def step_indices(meta: AttentionMetadata) -> StepIndices:
    """The step's indices; a metadata object that never went through a forward gets its own."""
    if meta.step_indices is None:
        meta.step_indices = StepIndices(meta)
    return meta.step_indices


class StepIndices:
    """What the torch path derives from a step's inputs, computed by the first layer that asks."""

    def __init__(self, meta: AttentionMetadata):
        self.meta = meta
        self._rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._write: tuple[torch.Tensor | None, torch.Tensor] | None = None
        self._decode: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}  # by window

    def rope(self, positions: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, 1, D] cos | cos, [T, 1, D] -sin | sin) at `positions` (every layer passes the same ones)."""
        if self._rope is None or self._rope[0] is not positions or self._rope[1] is not table:
            cos, sin = table[positions].unsqueeze(1).chunk(2, dim=-1)
            self._rope = (positions, table, torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1))
        return self._rope[2], self._rope[3]

    def write(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(token rows whose K/V are written, None for all; their int64 slots). -1 marks padding."""
        if self._write is None:
            slots = self.meta.slot_mapping.long()
            keep = slots >= 0
            self._write = (None, slots) if bool(keep.all()) else (keep.nonzero().squeeze(1), slots[keep])
        return self._write

    def decode_gather(self, block_size: int, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode steps: every sequence's context blocks, as many as the longest needs (the rest
        of a shorter table is read and masked), flattened [B * blocks]; and the additive mask
        [B, 1, 1, blocks * block_size] hiding slots past each context (and, with a window, before
        its last `window` keys). Lengths come from the device tensor (a decode graph's host
        lengths are placeholders), so a graph's padded batch computes exactly what the eager batch does."""
        if window not in self._decode:
            meta = self.meta
            num_blocks = -(-int(meta.seq_lens.max()) // block_size)
            positions = torch.arange(num_blocks * block_size, device=meta.block_tables.device)
            seq_lens = meta.seq_lens.unsqueeze(1)
            hidden = positions >= seq_lens
            if window is not None:
                hidden |= positions < seq_lens - window
            mask = torch.zeros_like(hidden, dtype=torch.float32).masked_fill(hidden, float("-inf"))
            self._decode[window] = (meta.block_tables[:, :num_blocks].flatten().long(), mask[:, None, None, :])
        return self._decode[window]
