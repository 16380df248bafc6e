"""Long prefill chunks through torch's FlashAttention (scaled_dot_product_attention's fused kernels).

The project's Triton prefill kernel (ops/triton_attention.py) reads K/V through the block table a
64-key tile at a time. On an H100 (Llama-3.1-8B's heads, benchmarks/results/gpu_flash_prefill_0e71985_h100.json)
an 8,192-query chunk took 2.01 ms there against 1.05 through torch, its gather included; on 8K-24K
cached tokens 5.8 / 13.8 ms against 4.8 / 11.7; at 1,024 queries without context 0.063 against 0.096
(the gather and the host's calls cost ~60 us a layer). So an eager step's chunks of at least
KernelOptions.flash_prefill_min_tokens queries gather their sequence's K/V into contiguous tensors
and attend there; shorter chunks, decodes and CUDA-graph steps stay on the Triton kernels.

A chunk's queries are the last q_len of its seq_len positions, so its causal mask is aligned to the
bottom right (torch.nn.attention.bias.causal_lower_right), which flash supports with grouped-query
heads. Layers with a sliding window or a soft cap, float32 models and GPUs without flash keep the
Triton kernel.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_prefill_sequences(q: torch.Tensor, num_kv_heads: int, query_lens: list[int], first_seq: int,
                            min_tokens: int, window: int | None, softcap: float | None) -> list[int]:
    """The sequences (from first_seq on) whose chunk goes to flash: those of at least min_tokens
    queries (0: none), where flash can compute the layer at all."""
    if min_tokens <= 0 or window is not None or softcap is not None or q.dtype not in FLASH_DTYPES:
        return []
    chosen = [i for i in range(first_seq, len(query_lens)) if query_lens[i] >= min_tokens]
    return chosen if chosen and flash_usable(q.device, q.dtype, q.shape[1], num_kv_heads, q.shape[2]) else []


@functools.cache
def flash_usable(device: torch.device, dtype: torch.dtype, num_q_heads: int, num_kv_heads: int,
                 head_dim: int) -> bool:
    """Whether torch's flash backend takes these heads on this device (else SDPA would fall back to a
    materialized mask, far slower). Asked once per model shape, not every layer."""
    if device.type != "cuda":
        return False
    query = torch.empty(1, num_q_heads, 1, head_dim, device=device, dtype=dtype)
    key = query[:, :num_kv_heads]
    params = torch.backends.cuda.SDPAParams(query, key, key, None, 0.0, False, True)
    return torch.backends.cuda.can_use_flash_attention(params)


def flash_prefill(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [L, Hq, D], the last L queries of the S positions in key, value: [S, Hk, D] -> [L, Hq, D]."""
    from torch.nn.attention.bias import causal_lower_right  # here: importing it loads torch._dynamo (~2 s)

    query_len, key_len = q.shape[0], key.shape[0]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0),
        attn_mask=causal_lower_right(query_len, key_len), scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
