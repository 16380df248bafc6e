"""The GEMV family (ops/triton_gemv.py) under TRITON_INTERPRET=1 against dequantize-then-matmul in float64.

Every path: one row on the CUDA cores (block_m 1) or rows padded to a tensor-core tile (block_m 16,
also at M = 1), unsplit and split K, whole and ragged last K steps, N not a multiple of the block,
for dense, int8 and int4 weights. Float32 inputs must match to float32 rounding (a wrong nibble
order or group is off by tens of percent); 16-bit inputs within their rounding.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from goodserve.ops import triton_gemv  # noqa: E402
from goodserve.ops.activation import silu_and_mul_torch  # noqa: E402
from goodserve.ops.triton_gemv import GemvConfig, gemv, gemv_config, split_plan  # noqa: E402
from goodserve.quant import schemes  # noqa: E402

GROUP = 64
FORMATS = ["dense", "int8", "int4"]
# (M, block_m): one row on either path, a few rows, the most rows
ROWS = [(1, 1), (1, 16), (3, 16), (16, 16)]
# (N, K, block_k): whole steps; K = 320 with steps of 128 leaves a half step (int4: 5 groups of 64)
SHAPES = [(40, 256, None), (33, 320, 128)]


def weight_and_reference(fmt: str, n: int, k: int, seed: int = 0):
    """(gemv's weight arguments, the float64 weight they stand for)."""
    torch.manual_seed(seed)
    w = torch.randn(n, k) + 0.3  # offset: int4 zero points must matter
    if fmt == "dense":
        return (w,), w.double()
    if fmt == "int8":
        q = schemes.quantize_int8(w)
        return (q.qweight, q.scales), schemes.dequantize_int8(q).double()
    q = schemes.quantize_int4(w, GROUP)
    return (q.qweight, q.scales, q.zeros, GROUP), schemes.dequantize_int4(q).double()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,block_m", ROWS)
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("n,k,block_k", SHAPES)
def test_gemv_matches_dequantized_matmul(fmt, m, block_m, split_k, n, k, block_k):
    args, w = weight_and_reference(fmt, n, k, seed=m + k)
    x = torch.randn(m, k)
    out = gemv(x, args[0], fmt, *args[1:], block_m=block_m, split_k=split_k, block_k=block_k)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert relative_error(out, x.double() @ w.T) < 2e-5


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_keeps_half_precision_activations(fmt, m, dtype):
    args, w = weight_and_reference(fmt, 48, 256, seed=m)
    if fmt == "dense":
        args = (args[0].to(dtype),)
        w = args[0].double()
    x = torch.randn(m, 256).to(dtype)
    out = gemv(x, args[0], fmt, *args[1:], split_k=2)
    assert out.dtype == dtype
    assert relative_error(out, x.double() @ w.T) < 2e-2  # the interpreter truncates to 16 bits


@pytest.mark.parametrize("block_m", [1, 16])
def test_int4_columns_come_back_in_order(block_m):
    """One-hot rows pick single weight columns: every nibble must land on its own column (low
    nibble = even column) with its own group's scale and zero, also across group boundaries."""
    args, w = weight_and_reference("int4", 32, 4 * GROUP, seed=7)
    rows = 16 if block_m == 16 else 1
    few = [0, 1, GROUP - 1, GROUP, GROUP + 1, 4 * GROUP - 1]
    cols = torch.arange(4 * GROUP) if block_m == 16 else torch.tensor(few)
    for batch in cols.split(rows):
        x = torch.zeros(len(batch), 4 * GROUP)
        x[torch.arange(len(batch)), batch] = 1
        out = gemv(x, args[0], "int4", *args[1:], block_m=block_m, split_k=2)
        torch.testing.assert_close(out.double(), w[:, batch].T, rtol=1e-6, atol=1e-6)


def test_split_k_is_deterministic_and_leaves_its_counters_clear():
    args, _ = weight_and_reference("int8", 40, 512)
    x = torch.randn(2, 512)
    first = gemv(x, args[0], "int8", *args[1:], split_k=4, block_k=64)
    assert torch.equal(first, gemv(x, args[0], "int8", *args[1:], split_k=4, block_k=64))
    assert not triton_gemv.split_counters(x.device).any()


def test_split_plan_covers_k_exactly_once():
    for k, block_k, split_k in [(14336, 512, 3), (4096, 256, 7), (320, 128, 2), (256, 64, 64), (4096, 512, 1)]:
        splits, steps = split_plan(k, block_k, split_k)
        per_split = steps * block_k
        assert splits <= split_k and (splits - 1) * per_split < k <= splits * per_split


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 4, 16])
def test_default_configs_for_llama_shapes_are_valid(fmt, m):
    """Every Llama-3.1-8B shape gets a launchable config on a 132-SM GPU; the splits fill the GPU
    where N alone does not (o_proj) and stay off where it does (lm_head)."""
    group = 128 if fmt == "int4" else 0
    shapes = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "lm_head": (128256, 4096)}
    for name, (n, k) in shapes.items():
        config = triton_gemv.default_config(fmt, m, n, k, group, sms=132)
        triton_gemv._check_config(config, fmt, m, group)
        assert config.block_m == (1 if m == 1 else 16)
        if name == "lm_head":
            assert config.split_k == 1
    assert triton_gemv.default_config(fmt, m, 4096, 4096, group, sms=132).split_k > 1


def test_overrides_replace_the_defaults_and_bad_ones_are_refused():
    config = gemv_config("int4", 1, 64, 512, 64, torch.device("cpu"), block_n=8, num_warps=1, split_k=2)
    assert (config.block_n, config.num_warps, config.split_k) == (8, 1, 2)
    for bad in [dict(block_m=1), dict(block_k=48), dict(num_warps=3)]:
        with pytest.raises(ValueError):
            gemv_config("int8", 4, 64, 512, 0, torch.device("cpu"), **bad)
    with pytest.raises(ValueError, match="multiple of the group"):
        gemv_config("int4", 1, 64, 512, 128, torch.device("cpu"), block_k=64)


def test_tuned_configs_apply_on_cuda_only(monkeypatch):
    tuned = GemvConfig(1, 8, 256, 2, 1, 5)
    monkeypatch.setitem(triton_gemv.TUNED_CONFIGS, ("int8", 1, 64, 512), tuned)
    assert gemv_config("int8", 1, 64, 512, 0, torch.device("cpu")) != tuned
    monkeypatch.setattr(triton_gemv, "num_sms", lambda device: 132)
    assert gemv_config("int8", 1, 64, 512, 0, torch.device("cuda", 0)) == tuned
    assert gemv_config("int8", 1, 64, 512, 0, torch.device("cuda", 0), split_k=1).split_k == 1


# ---- int4, one row: the thread-per-row kernel (int4_rows_gemv), both layouts ----------------


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every float tensor the launch allocates starts as NaN: an output element no program writes
    (or a partial the finish reads unwritten) shows up in the comparison."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


def rows_weight(layout: str, n: int, k: int, group: int, block_n: int, seed: int):
    """(int4_rows_gemv's weight arguments, the float64 weight they stand for): the repacked layouts
    ("repacked", "paired") keep bfloat16 scales and midpoints, so their reference rounds them the
    same way."""
    torch.manual_seed(seed)
    q = schemes.quantize_int4(torch.randn(n, k) + 0.3, group)
    if layout == "checkpoint":
        return (q.qweight, q.scales, q.zeros, group), schemes.dequantize_int4(q).double()
    scales = q.scales.bfloat16().double()
    zeros = (q.zeros + 8 * q.scales).bfloat16().double() - 8 * scales  # stored as the group's midpoint
    rounded = schemes.Int4Weight(q.qweight, scales, zeros, group)
    return (triton_gemv.int4_rows_layout(q.qweight, q.scales, q.zeros, group, block_n, layout == "paired"),), \
        schemes.dequantize_int4(rounded).double()


# the mantissa decode and the subnormal one
DECODES = [dict(denormal=False), dict(denormal=True)]
# (N, K, group, block_n): N a multiple of the block or not (33, 70: a ragged last block), 1-8 groups
ROWS_SHAPES = [(40, 256, 64, 8), (33, 512, 128, 16), (70, 256, 32, 32), (64, 128, 64, 64)]


@pytest.mark.parametrize("layout", ["checkpoint", "repacked"])
@pytest.mark.parametrize("n,k,group,block_n", ROWS_SHAPES)
@pytest.mark.parametrize("split_k", [1, pytest.param(3, marks=pytest.mark.slow), None])  # 3: the full tier
@pytest.mark.parametrize("decode", DECODES)
def test_int4_rows_matches_dequantized_matmul(poisoned_empty, layout, n, k, group, block_n, split_k, decode):
    args, w = rows_weight(layout, n, k, group, block_n, seed=n + k)
    x = torch.randn(1, k)
    out = triton_gemv.int4_rows_gemv(x, *args, block_n=block_n, split_k=split_k, **decode)
    assert out.shape == (1, n) and out.dtype == torch.float32
    assert relative_error(out, x.double() @ w.T) < 2e-5
    if split_k:
        assert not triton_gemv.split_counters(x.device).any()


@pytest.mark.parametrize("layout", ["checkpoint", "repacked"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_rows_keeps_half_precision_activations(poisoned_empty, layout, dtype):
    args, w = rows_weight(layout, 48, 256, 64, 16, seed=3)
    x = torch.randn(1, 256).to(dtype)
    out = triton_gemv.int4_rows_gemv(x, *args, block_n=16, split_k=2)
    assert out.dtype == dtype
    assert relative_error(out, x.double() @ w.T) < 2e-2


# repacked: the full tier's (the dequantized-matmul test above runs both layouts fast)
@pytest.mark.parametrize("layout", ["checkpoint", pytest.param("repacked", marks=pytest.mark.slow)])
@pytest.mark.parametrize("decode", DECODES)
def test_int4_rows_columns_come_back_in_order(layout, decode):
    """One-hot rows: every nibble of every 16-byte chunk lands on its own column, with its own
    group's scale and zero, across chunk and group boundaries."""
    args, w = rows_weight(layout, 24, 4 * GROUP, GROUP, 8, seed=7)
    for col in [0, 1, 2, 3, 4, 5, 6, 7, 8, 31, 32, 33, GROUP - 1, GROUP, GROUP + 1, 4 * GROUP - 1]:
        x = torch.zeros(1, 4 * GROUP)
        x[0, col] = 1
        out = triton_gemv.int4_rows_gemv(x, *args, block_n=8, split_k=2, **decode)
        torch.testing.assert_close(out[0].double(), w[:, col], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n,k,group,block_n", [(40, 256, 64, 8), (70, 256, 32, 32), (64, 128, 64, 64)])
@pytest.mark.parametrize("split_k", [1, 3])
def test_int4_rows_paired_layout_stores_rows_at_their_own_index(poisoned_empty, n, k, group, block_n, split_k):
    """Rows j and N/2 + j share a program; a plain call still gives y in the weight's row order."""
    args, w = rows_weight("paired", n, k, group, block_n, seed=n + k)
    x = torch.randn(1, k)
    out = triton_gemv.int4_rows_gemv(x, *args, block_n=block_n, split_k=split_k, denormal=True)
    assert out.shape == (1, n)
    assert relative_error(out, x.double() @ w.T) < 2e-5


@pytest.mark.parametrize("n,k,group,block_n", [(40, 256, 64, 8), (70, 256, 32, 32), (64, 128, 64, 64)])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_rows_gated_output_is_silu_and_mul_of_the_projection(poisoned_empty, n, k, group, block_n, split_k,
                                                                  dtype):
    """gated: [1, N / 2] = silu(gate) * up of the projection's [gate | up] rows, rounded as the unfused
    path (projection in dtype, then ops/activation's silu_and_mul) rounds it."""
    args, w = rows_weight("paired", n, k, group, block_n, seed=n * k)
    x = torch.randn(1, k).to(dtype)
    out = triton_gemv.int4_rows_gemv(x, *args, block_n=block_n, split_k=split_k, gated=True, denormal=True)
    assert out.shape == (1, n // 2) and out.dtype == dtype
    reference = silu_and_mul_torch((x.double() @ w.T).to(dtype))
    assert relative_error(out, reference.double()) < (2e-5 if dtype == torch.float32 else 2e-2)
    if split_k > 1:
        assert not triton_gemv.split_counters(x.device).any()


def test_int4_rows_gated_output_needs_a_paired_layout():
    args, _ = rows_weight("repacked", 40, 256, 64, 8, seed=1)
    with pytest.raises(AssertionError, match="paired"):
        triton_gemv.int4_rows_gemv(torch.randn(1, 256), *args, gated=True)


@pytest.mark.parametrize("scale", [1e-4, 1e4])
def test_int4_rows_subnormal_decode_holds_over_the_activation_range(scale):
    """The subnormal decode scales x by up to 2**89: products stay normal and finite for small and
    large activations."""
    args, w = rows_weight("checkpoint", 40, 256, 64, 8, seed=11)
    x = torch.randn(1, 256) * scale
    out = triton_gemv.int4_rows_gemv(x, *args, block_n=8, denormal=True)
    assert relative_error(out, x.double() @ w.T) < 2e-5


def test_int4_rows_configs_for_llama_shapes_split_only_the_small_layers(monkeypatch):
    monkeypatch.setattr(triton_gemv, "num_sms", lambda device: 132)  # an H100's
    shapes = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "lm_head": (128256, 4096)}
    configs = {name: triton_gemv.int4_rows_config(n, k, 128, torch.device("cpu"))
               for name, (n, k) in shapes.items()}
    assert configs["o_proj"].split_k > 1 and configs["lm_head"].split_k <= 2
    assert all(c.split_k <= k // 128 for c, (_, k) in zip(configs.values(), shapes.values()))
    with pytest.raises(ValueError):
        triton_gemv.int4_rows_config(64, 512, 64, torch.device("cpu"), block_n=24)
