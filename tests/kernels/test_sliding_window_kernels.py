"""Sliding-window attention in every attention path (torch reference, torch decode, native CPU decode,
Triton decode and prefill under TRITON_INTERPRET=1) against a brute-force softmax over the keys each
query may see: positions j with i - j < W; and soft-capped scores (Gemma 2) in each of those paths
that takes them (the native CPU kernels do not: attention() keeps a soft-capped layer off them)."""

from __future__ import annotations

import pytest
import torch

from goodserve.native import layer_ops
from goodserve.ops.attention import decode_attention_torch, paged_attention_reference
from test_triton_attention import assert_close, kernels, make_batch  # noqa: F401 (kernels: a fixture)

SCALE = 0.3


def brute_force(q, cache, meta, window: int | None, softcap: float | None = None) -> torch.Tensor:
    """Each query row against its visible keys, one row at a time (GQA by repeating KV heads)."""
    out, start = torch.empty_like(q, dtype=torch.float32), 0
    block_size = cache.block_size
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        pos = torch.arange(seq_len)
        slots = meta.block_tables[i, pos // block_size].long() * block_size + pos % block_size
        k, v = (pool.flatten(0, 1)[slots].float() for pool in (cache.k, cache.v))
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        for row in range(q_len):
            query_pos = seq_len - q_len + row
            lo = 0 if window is None else max(query_pos - window + 1, 0)
            keys, values = k[lo : query_pos + 1], v[lo : query_pos + 1]  # [n, H, D]
            scores = torch.einsum("hd,nhd->hn", q[start + row].float(), keys) * SCALE
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            out[start + row] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
        start += q_len
    return out


# Contexts shorter than, equal to and longer than the window; window off block boundaries.
DECODES = [(1, 1), (1, 10), (1, 23), (1, 24), (1, 70), (1, 150)]
MIXED = [(1, 150), (5, 5), (20, 37), (40, 90), (1, 30), (3, 3)]
WINDOWS = [None, 23, 16]


@pytest.mark.parametrize("window", WINDOWS)
def test_torch_reference_prefill(window):
    q, cache, meta = make_batch(MIXED, 6, 2, 32, torch.float32, torch.float32)
    assert_close(paged_attention_reference(q, cache, meta, SCALE, window), brute_force(q, cache, meta, window),
                 torch.float32)


@pytest.mark.parametrize("window", WINDOWS)
def test_torch_decode(window):
    q, cache, meta = make_batch(DECODES, 6, 2, 32, torch.float32, torch.float32)
    assert_close(decode_attention_torch(q, cache, meta, SCALE, window), brute_force(q, cache, meta, window),
                 torch.float32)
    one = make_batch([(1, 70)], 4, 1, 32, torch.float32, torch.float32)  # batch 1 takes the bmm path
    assert_close(decode_attention_torch(*one, SCALE, window), brute_force(*one, window), torch.float32)


@pytest.mark.parametrize("window", WINDOWS)
def test_native_decode(window):
    q, cache, meta = make_batch(DECODES, 6, 2, 32, torch.float32, torch.float32)
    if not layer_ops.usable(q, cache.k):
        pytest.skip("native CPU kernels not built here")
    out = layer_ops.decode_attention(q, cache.k, cache.v, meta.block_tables, meta.seq_lens, SCALE, window)
    assert_close(out, brute_force(q, cache, meta, window), torch.float32)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_triton_decode(kernels, window, num_splits):  # noqa: F811
    q, cache, meta = make_batch(DECODES, 6, 2, 32, torch.float32, torch.float32)
    out = kernels.triton_decode_attention(q, cache, meta.block_tables, meta.seq_lens, SCALE, num_splits,
                                          window=window)
    assert_close(out, brute_force(q, cache, meta, window), torch.float32)


@pytest.mark.parametrize("window", WINDOWS)
def test_triton_prefill(kernels, window):  # noqa: F811
    q, cache, meta = make_batch(MIXED, 6, 2, 32, torch.float32, torch.float32)
    out = kernels.triton_prefill_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                           SCALE, window=window)
    assert_close(out, brute_force(q, cache, meta, window), torch.float32)


def test_keys_outside_the_window_are_never_read(kernels):  # noqa: F811
    """Blocks wholly before every query's window may be freed and reused: poison them; no kernel may
    read them (a NaN would spread to the output)."""
    window = 20
    q, cache, meta = make_batch([(1, 150), (40, 90)], 6, 2, 32, torch.float32, torch.float32)
    ref = brute_force(q, cache, meta, window)
    for i, (q_len, seq_len) in enumerate([(1, 150), (40, 90)]):
        oldest = seq_len - q_len - window + 1
        for block in meta.block_tables[i, : oldest // cache.block_size].tolist():
            cache.k[block], cache.v[block] = float("nan"), float("nan")
    out = kernels.triton_prefill_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                           SCALE, window=window)
    assert_close(out, ref, torch.float32)
    decode = slice(0, 1)
    out = kernels.triton_decode_attention(q[decode], cache, meta.block_tables[decode], meta.seq_lens[decode],
                                          SCALE, 4, window=window)
    assert_close(out, ref[decode], torch.float32)


SOFTCAP = 1.5


@pytest.mark.parametrize("window", [None, 16])
def test_soft_capped_scores_in_every_path(kernels, window):  # noqa: F811
    mixed = make_batch(MIXED, 6, 2, 32, torch.float32, torch.float32)
    decodes = make_batch(DECODES, 6, 2, 32, torch.float32, torch.float32)
    one = make_batch([(1, 70)], 4, 1, 32, torch.float32, torch.float32)
    expected = {name: brute_force(*batch, window, SOFTCAP) for name, batch in
                (("mixed", mixed), ("decodes", decodes), ("one", one))}
    assert not torch.allclose(expected["mixed"], brute_force(*mixed, window), atol=1e-2)  # the cap bites
    assert_close(paged_attention_reference(*mixed, SCALE, window, SOFTCAP), expected["mixed"], torch.float32)
    assert_close(decode_attention_torch(*decodes, SCALE, window, SOFTCAP), expected["decodes"], torch.float32)
    assert_close(decode_attention_torch(*one, SCALE, window, SOFTCAP), expected["one"], torch.float32)
    q, cache, meta = mixed
    out = kernels.triton_prefill_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                           SCALE, window=window, softcap=SOFTCAP)
    assert_close(out, expected["mixed"], torch.float32)
    q, cache, meta = decodes
    for num_splits in (1, 4):
        out = kernels.triton_decode_attention(q, cache, meta.block_tables, meta.seq_lens, SCALE, num_splits,
                                              window=window, softcap=SOFTCAP)
        assert_close(out, expected["decodes"], torch.float32)
