"""Every native (ctypes) entry point refuses a tensor it cannot read with a Python exception before
the foreign call, and the quantized linears never send a CUDA (or other non-CPU) tensor to a CPU
kernel (the crash this guards against: an int4 prefill on CUDA passed device pointers to the native int4 kernel
and the process died with a segmentation fault).

'meta' tensors stand in for CUDA ones: same failure (data_ptr() is not host memory), and they exist
on a CPU-only machine. Without the checks, each case here crashes the test process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from goodserve import LLM
from goodserve.native import build, layer_ops
from goodserve.native.int4_gemv import Int4Layout
from goodserve.native.operands import NativeOperandError
from goodserve.native.q8_gemv import Q8Layout
from goodserve.quant import linear
from goodserve.quant.gguf_native import Int8GroupLinear
from goodserve.quant.linear import CPU_NATIVE_MAX_M, CUDA_KERNEL_MAX_M, Int4Linear, matmul_path
from helpers import loaded_model

pytestmark = pytest.mark.skipif(build.library() is None, reason="native library not built")
T, HQ, HK, D, BLOCKS, BLOCK = 3, 4, 2, 16, 4, 8


def meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


def f32(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def layout(n: int = 8, k: int = 64) -> Int4Layout:
    torch.manual_seed(0)
    lin = Int4Linear.from_linear(torch.nn.Linear(k, n, bias=False), 32)
    return Int4Layout.from_codes(lin.qweight, lin.scales, lin.zeros, 32)


def rope_args() -> dict:
    return dict(q=f32(T, HQ, D), k=f32(T, HK, D), v=f32(T, HK, D), positions=torch.arange(T),
                rotary_cache=f32(32, D), k_pool=f32(BLOCKS, BLOCK, HK, D), v_pool=f32(BLOCKS, BLOCK, HK, D),
                slot_mapping=torch.arange(T))


def attention_args() -> dict:
    return dict(q=f32(T, HQ, D), k_pool=f32(BLOCKS, BLOCK, HK, D), v_pool=f32(BLOCKS, BLOCK, HK, D),
                block_tables=torch.zeros(T, 2, dtype=torch.int32), seq_lens=torch.ones(T, dtype=torch.int32),
                scale=0.25)


def spoiled(args: dict, name: str, how: str) -> dict:
    t = args[name]
    if how == "meta":
        bad = meta(t)
    elif how == "dtype":
        bad = t.to(torch.float64 if t.is_floating_point() else torch.float32)
    elif how == "strided":  # every other element along the last dim: no kernel reads that
        bad = torch.stack([t, t], dim=-1).flatten(-2)[..., ::2]
    else:  # "shape": one element short along the first dim
        bad = t[:-1]
    return {**args, name: bad}


@pytest.mark.parametrize("how", ["meta", "dtype", "strided", "shape"])
@pytest.mark.parametrize("name", ["q", "k", "v", "rotary_cache", "k_pool", "v_pool"])
def test_rope_write_kv_refuses(name, how):
    if name == "rotary_cache" and how in ("shape", "strided"):
        pytest.skip("any number of positions is a valid table, and a strided one is copied")
    with pytest.raises(NativeOperandError, match=None if how == "shape" else name):  # q sets the token count
        layer_ops.rope_write_kv(**spoiled(rope_args(), name, how))


@pytest.mark.parametrize("name", ["positions", "slot_mapping"])
def test_rope_write_kv_refuses_index_vectors(name):
    for how in ("meta", "shape"):
        with pytest.raises(NativeOperandError, match=name):
            layer_ops.rope_write_kv(**spoiled(rope_args(), name, how))


@pytest.mark.parametrize("how", ["meta", "dtype", "strided", "shape"])
@pytest.mark.parametrize("name", ["q", "k_pool", "v_pool", "block_tables", "seq_lens"])
def test_decode_attention_refuses(name, how):
    if name in ("block_tables", "seq_lens") and how in ("dtype", "strided"):
        pytest.skip("converted to int32 (a copy), and tables take any strides")
    with pytest.raises(NativeOperandError):
        layer_ops.decode_attention(**spoiled(attention_args(), name, how))


@pytest.mark.parametrize("how", ["meta", "dtype"])
def test_norm_and_activation_refuse(how):
    x, weight = f32(T, 32), f32(32)
    cases = [lambda: layer_ops.add_rms_norm(**spoiled(dict(x=x, residual=x, weight=weight, eps=1e-5), name, how))
             for name in ("x", "residual", "weight")]
    cases.append(lambda: layer_ops.silu_and_mul(**spoiled(dict(gate_up=f32(T, 64)), "gate_up", how)))
    for case in cases:
        with pytest.raises(NativeOperandError):
            case()
    with pytest.raises(NativeOperandError, match="weight"):
        layer_ops.add_rms_norm(x, None, f32(31), 1e-5)
    with pytest.raises(NativeOperandError, match="even"):
        layer_ops.silu_and_mul(f32(T, 63))


@pytest.mark.parametrize("how", ["meta", "dtype", "3-D", "wrong K"])
def test_int4_gemv_refuses_rows(how):
    rows = {"meta": meta(f32(2, 64)), "dtype": f32(2, 64).double(), "3-D": f32(2, 1, 64),
            "wrong K": f32(2, 63)}[how]
    with pytest.raises(NativeOperandError, match="rows"):
        layout().matmul(rows)


def test_int4_gemv_refuses_tiles_it_cannot_read():
    moved = layout()
    moved.tiles = meta(moved.tiles)
    with pytest.raises(NativeOperandError, match="tiles"):
        moved.matmul(f32(1, 64))
    short = layout()
    short.tiles = short.tiles[:, :1]
    with pytest.raises(NativeOperandError, match="tiles"):
        short.matmul(f32(1, 64))


def test_q8_gemv_refuses_tiles_and_rows_it_cannot_read():
    q8 = Q8Layout.from_codes(torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 2))
    with pytest.raises(NativeOperandError, match="rows"):
        q8.matmul(meta(f32(1, 64)))
    with pytest.raises(NativeOperandError, match="rows"):
        q8.matmul(f32(1, 32))
    q8.tiles = q8.tiles[:, :1]
    with pytest.raises(NativeOperandError, match="tiles"):
        q8.matmul(f32(1, 64))


@pytest.fixture(scope="module")
def int4_model():
    return loaded_model(LLM("dummy:tiny", quantization="int4", quantization_group_size=32, num_kv_blocks=16))


def decoder_stack_args(model) -> dict:
    attn = model.model.layers[0].self_attn
    hidden = attn.qkv_proj.in_features
    pool = (BLOCKS, BLOCK, attn.num_kv_heads, attn.head_dim)
    return dict(x=f32(T, hidden), positions=torch.arange(T), rotary_cache=f32(64, attn.head_dim),
                kv_caches=[SimpleNamespace(k=f32(*pool), v=f32(*pool)) for _ in model.model.layers],
                meta=SimpleNamespace(slot_mapping=torch.arange(T), seq_lens=torch.ones(T, dtype=torch.int32),
                                     block_tables=torch.zeros(T, 2, dtype=torch.int32)))


def test_decoder_stack_runs_on_good_operands(int4_model):
    out, residual = int4_model.native_decode(**decoder_stack_args(int4_model))
    assert out.shape == residual.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["x", "positions", "rotary_cache", "k", "v", "slot_mapping", "seq_lens",
                                  "block_tables"])
def test_decoder_stack_refuses_meta_operands(int4_model, name):
    args = decoder_stack_args(int4_model)
    holder = {"k": args["kv_caches"][-1], "v": args["kv_caches"][-1], "slot_mapping": args["meta"],
              "seq_lens": args["meta"], "block_tables": args["meta"]}.get(name)
    if holder is None:
        args[name] = meta(args[name])
    else:
        setattr(holder, name, meta(getattr(holder, name)))
    with pytest.raises(NativeOperandError):
        int4_model.native_decode(**args)


def test_decoder_stack_refuses_a_cache_list_of_another_length(int4_model):
    args = decoder_stack_args(int4_model)
    args["kv_caches"] = args["kv_caches"][:-1]
    with pytest.raises(NativeOperandError, match="caches"):
        int4_model.native_decode(**args)


def test_decoder_stack_refuses_weights_moved_off_the_cpu(int4_model):
    args = decoder_stack_args(int4_model)
    layer = int4_model.model.layers[1]
    layer.input_layernorm.weight = torch.nn.Parameter(meta(layer.input_layernorm.weight), requires_grad=False)
    with pytest.raises(NativeOperandError, match="input_norm"):
        int4_model.native_decode(**args)


@pytest.mark.parametrize("rows", [1, CUDA_KERNEL_MAX_M, CUDA_KERNEL_MAX_M + 1, CPU_NATIVE_MAX_M,
                                  CPU_NATIVE_MAX_M + 1, 128, 4096])
def test_cuda_rows_never_take_a_cpu_kernel(rows):
    assert matmul_path("cuda", rows, CPU_NATIVE_MAX_M) in ("cuda", "dequantized")
    assert matmul_path("cuda", rows, CPU_NATIVE_MAX_M) == ("cuda" if rows <= CUDA_KERNEL_MAX_M else "dequantized")
    assert matmul_path("meta", rows, CPU_NATIVE_MAX_M) == "dequantized"
    assert matmul_path("cpu", rows, CPU_NATIVE_MAX_M) == ("cpu_packed" if rows <= CPU_NATIVE_MAX_M else "dequantized")


@pytest.mark.parametrize("rows", [1, 2, CUDA_KERNEL_MAX_M + 1, 128])
def test_non_cpu_activations_never_reach_the_cpu_kernels(monkeypatch, rows):
    """Meta layers and activations (CUDA's stand-in) of any row count: the CPU kernels are never called."""
    def cpu_kernel(self, rows):
        raise AssertionError("a non-CPU tensor reached a CPU kernel")

    monkeypatch.setattr(Int4Linear, "_cpu_packed_matmul", cpu_kernel)
    monkeypatch.setattr(linear.Int8Linear, "_cpu_packed_matmul", cpu_kernel)
    layers = [Int4Linear(64, 16, group_size=32, device="meta"), linear.Int8Linear(64, 16, device="meta"),
              Int8GroupLinear(64, 16, device="meta")]
    for layer in layers:
        assert layer(torch.zeros(rows, 64, device="meta")).shape == (rows, 16)
